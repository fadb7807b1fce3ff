"""MoELayer: router -> dispatch -> experts -> combine, a drop-in for a dense FFN.

Shape legend: B batch, T sequence, N = B*T tokens, D model width, F expert width, E experts.

Aux losses are returned as values, never kept in global lists. A training loop gets them
in one of two ways:

* through the model: ``moe.model.MoETransformer`` sums every layer's ``Routing.aux_loss``
  into ``out.aux_loss`` and returns the routings in ``out.routings``;
* by hand: ``y, routing = layer(x, return_routing=True)`` and add ``routing.aux_loss``.

After each optimiser step call :func:`update_routers` so routers that learn from past
batches (aux-loss-free balancing, expert-choice thresholds) fold in what they saw.
"""

from __future__ import annotations

from torch import Tensor, nn

from moe.checks import nonnegative_int
from moe.exact import warn_inexact
from moe.experts import SwiGLUExperts, check_backend
from moe.latent import LatentProjections, latent_ffn_width
from moe.routers import build_router
from moe.routing import Claims, DecodeState, Router, Routing, check_input, held_claims
from moe.shared import SharedExperts


class MoELayer(nn.Module):
    """``y = MoELayer(d_model, d_ff, num_experts, router="topk", top_k=2)(x)`` with x [B, T, D].

    ``router`` is a registered name (see ``moe.list_routers()``) or a built ``Router``;
    ``router_options`` go to ``moe.build_router``. ``backend`` chooses the data path:
    "torch" (reference, any device), "triton" (our GPU kernels), "grouped_mm" (PyTorch's
    ``torch._grouped_mm``; float32 / bfloat16 / float16) or "auto" (grouped_mm on CUDA, torch
    elsewhere). Results do not depend on the backend beyond floating-point rounding.

    ``expert_parallel`` (a ``moe.parallel.ExpertParallel``, which carries the process group
    and the data path) shards the experts over the group's ranks: this rank holds experts
    ``local_experts = [start, stop)``, routes its own tokens and exchanges rows with the other
    ranks. Every rank of the group must run the layer in the same step. ``None`` (default):
    all experts local.

    ``experts`` (optional) is a prebuilt expert module to use instead of a fresh
    ``SwiGLUExperts``, e.g. a ``FusedSwiGLUExperts`` sharing another model's weights; it must
    hold this rank's experts with ``d_model`` and ``d_ff`` as given.

    ``shared_experts`` (S, default 0) adds S experts of width ``d_ff`` that every token uses
    beside its routed ones (``moe.shared.SharedExperts``: one SwiGLU of width S * d_ff, as
    DeepSeek-V2/V3 build them); ``shared_expert_gate`` scales their output per token by
    ``sigmoid(x . w)`` (Qwen2-MoE, Megatron-Core's ``moe_shared_expert_gate``). The output is
    routed + shared, as transformers' ``DeepseekV3MoE``, torchtitan's ``MoE`` and
    Megatron-Core's ``MoELayer`` add them (OLMo-core's ``MoEBase`` mixes them instead,
    ``shared / (k+1) + routed * k / (k+1)``). Under expert parallelism the shared experts are
    replicated like the router, and each rank runs them on its own tokens.

    ``latent_dim`` (L < D, default None: off) makes the routed experts latent experts
    (:mod:`moe.latent`; Megatron-Core ``moe_latent_size``, OLMo-core ``LatentMoEConfig.latent_dim``):
    the router still reads x [B, T, D], the experts (built with width L in, ``d_ff`` hidden) read
    ``latent.down(x)``, and the combined output goes through ``latent.up`` back to D.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        router: str | Router = "topk",
        backend: str = "torch",
        expert_parallel=None,
        experts: nn.Module | None = None,
        shared_experts: int = 0,
        shared_expert_gate: bool = False,
        latent_dim: int | None = None,
        **router_options,
    ) -> None:
        super().__init__()
        check_backend(backend)
        if isinstance(router, Router):
            if router_options:
                raise ValueError("router_options are only accepted with a router name")
            if (router.d_model, router.num_experts) != (d_model, num_experts):
                raise ValueError(
                    f"router built for d_model={router.d_model}, num_experts={router.num_experts}; "
                    f"layer has d_model={d_model}, num_experts={num_experts}"
                )
            self.router = router
        else:
            self.router = build_router(router, d_model=d_model, num_experts=num_experts, **router_options)
        self.expert_parallel = expert_parallel
        self.local_experts = (0, num_experts) if expert_parallel is None else expert_parallel.local_range(num_experts)
        num_local = self.local_experts[1] - self.local_experts[0]
        self.latent = None if latent_dim is None else LatentProjections(d_model, latent_dim)
        expert_in = d_model if latent_dim is None else latent_dim
        if experts is None:
            experts = SwiGLUExperts(num_local, expert_in, d_ff)
        elif (experts.num_experts, experts.d_model, experts.d_ff) != (num_local, expert_in, d_ff):
            raise ValueError(
                f"experts hold num_experts={experts.num_experts}, d_model={experts.d_model}, d_ff={experts.d_ff}; "
                f"layer needs {num_local}, {expert_in}, {d_ff}"
            )
        self.experts = experts
        nonnegative_int("shared_experts", shared_experts)
        if shared_expert_gate and not shared_experts:
            raise ValueError("shared_expert_gate needs shared_experts > 0")
        self.shared = SharedExperts(d_model, d_ff, shared_experts, shared_expert_gate) if shared_experts else None
        self.d_model, self.d_ff, self.num_experts = d_model, d_ff, num_experts
        self.backend = backend

    @property
    def claims(self) -> Claims:
        """What the layer promises (``moe.audit`` checks it, as any module's ``claims``): its
        router's claims (:func:`~moe.routing.held_claims`)."""
        return held_claims(self)

    def forward(
        self,
        x_BTD: Tensor,
        return_routing: bool = False,
        decode_state: DecodeState | None = None,
        token_ids_BT: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Routing]:
        """``decode_state`` (from ``self.router.init_decode_state(B)``): x holds the next tokens
        of the state's sequences, routed as in the full-sequence forward (see ``moe.routing``).
        ``token_ids_BT`` (int [B, T]): the ids of x's tokens, for a router that routes by them
        (``Router.reads_token_ids``, e.g. ``hash``); other routers ignore them."""
        check_input(x_BTD, self.d_model)
        b, t, d = x_BTD.shape
        if getattr(self.router, "reads_token_ids", False):  # a router module of the user's may not say
            routing = self.router(x_BTD, decode_state=decode_state, token_ids_BT=token_ids_BT)
        else:
            routing = self.router(x_BTD, decode_state=decode_state)
        if self.backend == "triton":
            warn_inexact("backend 'triton'", "its kernels are not blocked by rows (use 'torch' or 'grouped_mm')")
        x_ND = x_BTD.reshape(b * t, d)
        if self.latent is not None:
            x_ND = self.latent.down(x_ND)  # the routed path in the latent width L
        if self.expert_parallel is None:
            y_ND = self.experts(x_ND, routing.token, routing.expert, routing.weight, self.backend)
        else:
            y_ND = self.expert_parallel(
                x_ND, routing.token, routing.expert, routing.weight, self.experts, self.num_experts, self.backend
            )
        if self.latent is not None:
            y_ND = self.latent.up(y_ND.to(x_BTD.dtype))
        y_BTD = y_ND.view(b, t, d).to(x_BTD.dtype)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        return (y_BTD, routing) if return_routing else y_BTD

    def active_ffn_width(self) -> float | None:
        """The feed-forward width one token uses on average (:func:`active_ffn_width`)."""
        shared = 0 if self.shared is None else self.shared.num_shared
        return active_ffn_width(self.router, self.d_ff, shared, None if self.latent is None else self.latent.latent_dim)

    def extra_repr(self) -> str:
        ep = "" if self.expert_parallel is None else f", local_experts={self.local_experts}"
        return f"backend={self.backend!r}{ep}"


def active_ffn_width(router: Router, d_ff: int, shared_experts: int = 0, latent_dim: int | None = None) -> float | None:
    """The hidden width of the feed-forward that one token of an MoE layer uses on average:
    (the router's nominal experts per token + ``shared_experts``) * ``d_ff``, the width of the
    dense SwiGLU of equal active compute; None where the router's options set no number of
    experts per token (``Router.nominal_experts_per_token``). With latent experts
    (``latent_dim``), the routed part is :func:`moe.latent.latent_ffn_width` (the experts in the
    latent width and the two projections; the shared experts stay in D). A study that compares
    routers at equal compute compares this with the dense width."""
    k = router.nominal_experts_per_token()
    if k is None:
        return None
    routed = k * d_ff if latent_dim is None else latent_ffn_width(k, d_ff, router.d_model, latent_dim)
    return routed + shared_experts * d_ff


def update_routers(model: nn.Module) -> None:
    """Call ``update_after_step()`` on every router in ``model`` (after the optimiser step)."""
    for m in model.modules():
        if isinstance(m, Router):
            m.update_after_step()
