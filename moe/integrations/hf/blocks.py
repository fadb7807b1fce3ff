"""Replace the sparse MoE blocks of a Hugging Face transformers model by ``moe.MoELayer``.

Shape legend: B batch, T sequence, N = B*T tokens, D model width, F expert width, E experts,
K experts per token.

Every supported family (transformers 5.x) stores its experts the same way (``gate_up_proj``
[E, 2F, D], ``down_proj`` [E, D, F], SiLU) and gates with ``softmax(x W^T)`` over the E
experts followed by the top K, renormalised or not; they differ in where K and the
renormalisation live and in their shared expert. DeepSeek-V3 gates with sigmoid scores, a
fixed ``e_score_correction_bias`` for selection, group-limited top-K (``n_group``,
``topk_group``) and ``routed_scaling_factor``, which ``topk`` reproduces with its balance bias
sharing that buffer. :data:`FAMILIES` says so per block class.
The replacement block shares the original's parameters (the gate weight becomes the
router's gate weight, the expert tensors are viewed by ``FusedSwiGLUExperts``): nothing is
copied, and a swapped checkpoint keeps its parameter objects.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moe.experts import FusedSwiGLUExperts
from moe.layer import MoELayer
from moe.routers import ExpertChoiceBase, TokenChoiceBase, build_router
from moe.routing import DecodeState, Router, Routing, registered_routers


@dataclass(frozen=True)
class Family:
    """How one transformers MoE block class computes, read off its 5.x modeling file."""

    gate_attr: str
    """Attribute of the block holding the router (``weight`` [E, D], ``top_k``)."""
    normalize: bool | None
    """Whether the K kept probabilities are renormalised to sum to 1; None: the gate's
    ``norm_topk_prob`` says (a config field)."""
    shared_expert: str | None = None
    """Attribute of the block's shared expert(s), added to the routed output; None: none."""
    shared_expert_gate: str | None = None
    """Attribute of the linear whose sigmoid scales the shared output per token (Qwen2-MoE);
    None: the shared output is added as it is (DeepSeek-V3)."""
    deepseek_gate: bool = False
    """The gate is DeepSeek-V3's ``DeepseekV3TopkRouter`` (sigmoid, bias, groups, scale)."""


FAMILIES: dict[str, Family] = {
    # softmax -> top-k -> renormalise
    "MixtralSparseMoeBlock": Family("gate", normalize=True),
    "MiniMaxSparseMoeBlock": Family("gate", normalize=True),
    # top-k of the logits -> softmax over the K: the same weights as renormalising
    "GraniteMoeMoE": Family("router", normalize=True),
    # softmax -> top-k -> renormalise iff config.norm_topk_prob
    "OlmoeSparseMoeBlock": Family("gate", normalize=None),
    "FlexOlmoSparseMoeBlock": Family("gate", normalize=None),
    "Qwen3MoeSparseMoeBlock": Family("gate", normalize=None),
    # ... plus a sigmoid-gated shared expert
    "Qwen2MoeSparseMoeBlock": Family("gate", None, "shared_expert", "shared_expert_gate"),
    "Qwen3NextSparseMoeBlock": Family("gate", None, "shared_expert", "shared_expert_gate"),
    # sigmoid + correction bias, group-limited top-k, renormalise iff norm_topk_prob, scale; shared experts
    "DeepseekV3MoE": Family("gate", None, "shared_experts", deepseek_gate=True),
}
"""Block class name -> its family. Blocks of other classes are left alone."""

SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
"""Class names of the expert activations our SwiGLU experts compute (transformers' ``ACT2FN``)."""


class HFMoEBlock(nn.Module):
    """A transformers sparse MoE block rebuilt on :class:`moe.MoELayer`, with its calling
    convention: ``y_BTD = block(x_BTD)`` (what 5.x decoder layers expect of ``mlp``).

    ``moe`` routes with any registered router and runs the original experts' weights; a
    shared expert, where the family has one, is the original module, added as the original
    adds it (scaled by ``sigmoid(shared_expert_gate(x))`` where the family gates it). After each forward, ``routing`` holds that forward's :class:`moe.Routing` (aux
    loss, stats); :func:`swapped_routings` collects them over a model. Inside
    :func:`decoding`, ``decode_state`` is set and each call routes the next tokens of the
    sequences being generated (transformers' ``generate`` with its KV cache passes only those).
    """

    def __init__(
        self, moe: MoELayer, shared_expert: nn.Module | None = None, shared_expert_gate: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.routing: Routing | None = None
        self.decode_state: DecodeState | None = None
        self.token_ids_BT: Tensor | None = None
        """The ids of the model call running now, for a router that routes by them (set by the
        swapped model's forward hooks, :func:`hand_token_ids`)."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        y_BTD, self.routing = self.moe(
            hidden_states, return_routing=True, decode_state=self.decode_state, token_ids_BT=self.token_ids_BT
        )
        if self.shared_expert is not None:
            shared_BTD = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared_BTD = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared_BTD
            y_BTD = y_BTD + shared_BTD
        return y_BTD


def family_router_options(router: str, top_k: int, normalize: bool, token_choice: dict | None = None) -> dict:
    """The options that make ``router`` spend the family's compute: token-choice routers get the
    family's K and renormalisation, and ``token_choice`` (the rest of the family's top-k: DeepSeek-V3's
    score function, groups and scale), so ``topk`` reproduces the family exactly; expert-choice
    routers ``capacity_factor=K`` (each expert keeps K/E of the tokens: K experts per token on
    average). Other routers get nothing."""
    known = registered_routers()
    if router not in known:
        raise ValueError(f"unknown router {router!r}; known routers: {', '.join(sorted(known))}")
    cls = known[router]
    if issubclass(cls, TokenChoiceBase):
        return {"top_k": top_k, "normalize": normalize, **(token_choice or {})}
    if issubclass(cls, ExpertChoiceBase):
        return {"capacity_factor": float(top_k)}
    return {}


def _local_experts(gate_up_proj: nn.Parameter, down_proj: nn.Parameter, expert_parallel) -> FusedSwiGLUExperts:
    """The experts this rank runs: all of them, or with ``expert_parallel`` its block of
    ``local_range(E)`` (new parameters holding a copy of that slice; on the meta device, none)."""
    if expert_parallel is None:
        return FusedSwiGLUExperts(gate_up_proj, down_proj)
    start, stop = expert_parallel.local_range(gate_up_proj.shape[0])
    return FusedSwiGLUExperts(
        nn.Parameter(gate_up_proj.detach()[start:stop].clone()), nn.Parameter(down_proj.detach()[start:stop].clone())
    )


def swap_block(
    block: nn.Module, family: Family, router: str, backend: str, router_options: dict, expert_parallel=None
) -> HFMoEBlock:
    """One :class:`HFMoEBlock` sharing ``block``'s gate, experts (this rank's, with
    ``expert_parallel``) and shared expert."""
    gate, experts = getattr(block, family.gate_attr), block.experts
    if not isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter):
        raise ValueError(
            f"{type(block).__name__}: experts are not stored as gate_up_proj [E, 2F, D] / down_proj [E, D, F] "
            "(the transformers 5.x layout; older versions keep one module per expert)"
        )
    act = type(getattr(experts, "act_fn", None)).__name__
    if act not in SILU_ACTIVATIONS:
        raise ValueError(
            f"{type(block).__name__}: expert activation {act} is not SiLU; only SwiGLU experts are supported"
        )
    if getattr(block, "jitter_noise", 0.0):
        raise ValueError(
            f"{type(block).__name__}: router_jitter_noise={block.jitter_noise} is not reproduced by the swapped "
            "block; set config.router_jitter_noise = 0 before building the model"
        )
    normalize = gate.norm_topk_prob if family.normalize is None else family.normalize
    e, d = gate.weight.shape
    if (experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]) != (e, d):
        raise ValueError(
            f"{type(block).__name__}: gate is [{e}, {d}] but experts hold "
            f"{experts.gate_up_proj.shape[0]} x {experts.gate_up_proj.shape[2]}"
        )
    fused = _local_experts(experts.gate_up_proj, experts.down_proj, expert_parallel)
    own = deepseek_router_options(gate) if family.deepseek_gate else None
    options = {**family_router_options(router, gate.top_k, bool(normalize), own), **router_options}
    moe_router = build_router(router, d_model=d, num_experts=e, **options)
    moe_router.gate.weight = gate.weight
    if family.deepseek_gate and isinstance(moe_router, TokenChoiceBase):
        moe_router.balance_bias = gate.e_score_correction_bias  # shared: the buffer is the balance bias
    layer = MoELayer(
        d, fused.d_ff, e, router=moe_router, backend=backend, expert_parallel=expert_parallel, experts=fused
    )
    shared = None if family.shared_expert is None else getattr(block, family.shared_expert)
    shared_gate = None if family.shared_expert_gate is None else getattr(block, family.shared_expert_gate)
    return HFMoEBlock(layer, shared, shared_gate)


def deepseek_router_options(gate: nn.Module) -> dict:
    """The ``topk`` options of a transformers ``DeepseekV3TopkRouter`` (modeling_deepseek_v3.py):
    sigmoid scores, ``n_group`` groups of which each token keeps ``topk_group`` (scored by the
    sum of their best two biased scores), the kept weights renormalised iff ``norm_topk_prob``
    and scaled by ``routed_scaling_factor``. Its ``e_score_correction_bias`` becomes the
    router's ``balance_bias`` (added for selection only, as DeepSeek-V3 adds it)."""
    options = {"gate": "sigmoid", "route_scale": float(gate.routed_scaling_factor)}
    if gate.num_group is not None and gate.num_group > 1:
        options.update(num_expert_groups=int(gate.num_group), num_limited_groups=int(gate.topk_group))
    return options


def swap_moe_blocks(
    model: nn.Module, router: str = "ec_threshold", *, backend: str = "torch", expert_parallel=None, **router_options
) -> nn.Module:
    """Replace, in place, every sparse MoE block of a transformers model (a class in
    :data:`FAMILIES`: Mixtral, MiniMax, GraniteMoE, OLMoE, FlexOlmo, Qwen2-MoE, Qwen3-MoE,
    Qwen3-Next, DeepSeek-V3) by an :class:`HFMoEBlock` routing with ``router``; return the model.

    The new blocks share the original parameters (no copy). ``router_options`` go to
    ``moe.build_router`` on top of the family's own (see :func:`family_router_options`):
    ``swap_moe_blocks(model, "topk")`` computes what the original model computes.
    ``backend`` is ``MoELayer``'s ("torch", "triton", "grouped_mm", "auto"). With ``expert_parallel`` (a
    ``moe.parallel.ExpertParallel``) each block keeps only this rank's experts (copies of
    their slice) and exchanges tokens with the other ranks, as ``MoELayer`` does.

    ``model.swap_recipe`` keeps ``router`` and ``router_options`` (what an export rebuilds it from).

    Training: the swapped blocks' aux losses (and stats) are on their routings, collected by
    :func:`swapped_routings` after a forward; transformers' own load-balancing loss reads the
    router modules this replaces, so ``config.output_router_logits`` is set to False. Call
    ``moe.update_routers(model)`` after each optimiser step, as with any model of this package.
    """
    reads_ids = getattr(registered_routers().get(router), "reads_token_ids", False)
    if reads_ids and "vocab_size" in inspect.signature(registered_routers()[router]).parameters:
        router_options = {"vocab_size": model.config.vocab_size, **router_options}
    swaps = [
        (parent, name, child, FAMILIES[type(child).__name__])
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in FAMILIES
    ]
    if not swaps:
        raise ValueError(
            f"{type(model).__name__} has no sparse MoE block of a supported family ({', '.join(sorted(FAMILIES))})"
        )
    for parent, name, child, family in swaps:
        setattr(parent, name, swap_block(child, family, router, backend, router_options, expert_parallel))
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    model.swap_recipe = {"router": router, "router_options": dict(router_options)}
    model.register_forward_pre_hook(warn_outside_decoding, with_kwargs=True)
    if reads_ids:
        model.register_forward_pre_hook(hand_token_ids, with_kwargs=True)
        model.register_forward_hook(take_token_ids_back, always_call=True)
    return model


def hand_token_ids(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a model whose swapped blocks route by token id: its ``input_ids`` (the
    new tokens only, when ``generate`` decodes through the cache) go to every swapped block for
    this call (the matching forward hook takes them back). A call with ``inputs_embeds`` alone
    has no ids: one line."""
    ids_BT = kwargs.get("input_ids", args[0] if args else None)
    if ids_BT is None and kwargs.get("inputs_embeds") is not None:
        raise ValueError("the swapped MoE blocks route by token id: call the model with input_ids, not inputs_embeds")
    for block in model.modules():
        if isinstance(block, HFMoEBlock):
            block.token_ids_BT = ids_BT


def take_token_ids_back(model: nn.Module, args: tuple, output) -> None:
    """Forward hook (also after a failed call): the swapped blocks keep no ids of a finished call."""
    for block in model.modules():
        if isinstance(block, HFMoEBlock):
            block.token_ids_BT = None


def outside_decoding_misroute(router: Router) -> str | None:
    """Why ``router`` misroutes the new tokens of a call through transformers' cache outside
    :func:`decoding` (each call is routed as a sequence of its own), and what to do; None where
    such a call routes as the full forward does (a router that routes every token alone)."""
    reason = router.decode_support()
    if reason is not None:
        return (
            f"{reason}. With transformers, generate such a model with use_cache=False (outside decoding()): "
            "each step then reroutes the whole sequence so far, as the full forward routes it"
        )
    if type(router.init_decode_state(1)) is not DecodeState:
        return (
            f"router {router.name!r} routes new tokens from its decode state, which only decoding() keeps: "
            "generate inside `with decoding(model, batch_size=B):`"
        )
    return None


def warn_outside_decoding(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a swapped model: one warning, the first time it is called with a
    filled transformers cache (``generate`` decoding) outside :func:`decoding` while a router
    would misroute those tokens (:func:`outside_decoding_misroute`)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if getattr(model, "warned_outside_decoding", False) or not getattr(cache, "get_seq_length", lambda: 0)():
        return
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    if any(b.decode_state is not None for b in blocks):
        return
    for i, block in enumerate(blocks):
        why = outside_decoding_misroute(block.moe.router)
        if why is not None:
            model.warned_outside_decoding = True
            warnings.warn(f"generating outside decoding(): MoE block {i}: {why}", UserWarning, stacklevel=2)
            return


def swapped_routings(model: nn.Module) -> list[Routing]:
    """The routings of the last forward of every swapped block of ``model``, in module order."""
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    missing = [i for i, b in enumerate(blocks) if b.routing is None]
    if missing:
        raise ValueError(f"swapped blocks {missing} have not run a forward yet")
    return [b.routing for b in blocks]


@contextmanager
def decoding(model: nn.Module, batch_size: int) -> Iterator[nn.Module]:
    """Route incrementally while transformers generates with its KV cache::

        with decoding(model, batch_size=2):
            out = model.generate(ids_BT, max_new_tokens=16, do_sample=False)

    Every swapped block gets a fresh decode state of its router (``Router.init_decode_state``:
    a ValueError for a router that cannot decode, e.g. expert choice) and routes each call's
    tokens as the next ones of the ``batch_size`` sequences, so a decode-consistent router
    (``topk``, ``ec_threshold``, ``capacity`` with ``capacity_scope="prefix"``) gives at every
    step what the full-sequence forward of the generated text gives. Without it each call is
    routed as a sequence of its own: exact only for routers that route every token alone
    (``topk``, ``ec_threshold``); a prefix-scoped capacity router would see each new token at
    position 0. Needs the cache (``use_cache=True``, transformers' default) and prompts of
    equal length (all rows at the same position). The states are cleared on exit."""
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no swapped MoE block: call swap_moe_blocks first")
    for i, block in enumerate(blocks):
        reason = block.moe.router.decode_support()
        if reason is not None:
            raise ValueError(
                f"decoding(): MoE block {i}: {reason}. With transformers, call generate outside decoding() "
                "with use_cache=False: every step then reroutes the whole sequence so far"
            )
    try:
        for block in blocks:
            block.decode_state = block.moe.router.init_decode_state(batch_size)
        yield model
    finally:
        for block in blocks:
            block.decode_state = None
