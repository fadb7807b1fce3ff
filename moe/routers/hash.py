"""Hash routing: a token's experts are a fixed table's row for its token id (DeepSeek-V4's
first layers; Hash Layers, arXiv 2106.04426).

Shape legend: B batch, T sequence, N = B*T tokens, V vocabulary, E experts, K top-k,
A = N*K assignments.

``tid2eid`` (int64 [V, K], a persistent buffer) names the K experts of every token id. It is
drawn once, when the router is built, from a CPU generator seeded by ``table_seed``: each row
is the first K of a uniformly random permutation of the E experts (K distinct experts, every
expert equally likely), the distribution torchtitan's ``_build_hash_routing_table`` draws
from; a table loaded with a checkpoint (a DeepSeek-V4 one) replaces it. The gate still
learns: its scores weight the table's experts as top-k weights its own choices
(``TokenChoiceBase.combine_weights``: the scores at those experts, renormalised with
``normalize``, times ``route_scale``), as transformers' ``DeepseekV4HashRouter`` and
torchtitan's ``DeepSeekV4Router`` (``hash=True``) weight them.

Token n's experts read token n's id alone and its weights token n's hidden state alone:
causal, batch-invariant and decode-consistent in both modes by construction, decoding with
no state. The router needs the token ids: ``router(x_BTD, token_ids_BT=ids)``
(:attr:`moe.routing.Router.reads_token_ids`); ``MoELayer`` and ``MoETransformer`` pass them
(``ModelConfig.hash_layers`` routes the first blocks so, MaxText's
``first_num_hash_layers``, torchtitan's ``n_hash_layers``, transformers' ``num_hash_layers``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.checks import nonnegative_int, positive_int
from moe.routers.token_choice import TokenChoiceBase
from moe.routing import Claims, DecodeState, Routing, check_input, register_router, router_scores

SHARED_OPTIONS = ("top_k", "gate", "pre_softmax", "normalize", "route_scale", "router_dtype", "z_loss_coef")
"""The options a hash block takes from the model's ``router_options`` (``ModelConfig.hash_layers``):
those of the weights, which a DeepSeek-V4 hash layer shares with its other layers."""


def hash_table(vocab_size: int, num_experts: int, top_k: int, seed: int) -> Tensor:
    """int64 [V, K]: per token id the first K of a random permutation of the E experts, drawn on
    the CPU from ``seed`` (the same table on every rank, device and run)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(vocab_size, num_experts, generator=gen, device="cpu").argsort(dim=-1)[:, :top_k].contiguous()


@register_router("hash")
class HashRouter(TokenChoiceBase):
    """Experts ``tid2eid[token_id]``, weighted by the gate's scores at them.

    Options: ``vocab_size`` (V, default 256; a model sets its own), ``table_seed`` (default 0),
    ``top_k`` (default 2), ``gate`` (score function), ``pre_softmax``, ``normalize``,
    ``route_scale``, ``z_loss_coef``. Refused: balance losses (``aux_loss_coef`` defaults to
    0 here: the table fixes the loads, the gate cannot move them), ``balance_rate`` and
    expert groups (they change a selection the table makes).
    """

    reads_token_ids = True

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        vocab_size: int = 256,
        table_seed: int = 0,
        aux_loss_coef: float = 0.0,
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, aux_loss_coef=aux_loss_coef, **options)
        positive_int("vocab_size", vocab_size)
        nonnegative_int("table_seed", table_seed)
        self.refuse_balancing("hash routing takes its experts from a fixed table, which no balance loss can move")
        self.vocab_size = vocab_size
        self.table_seed = table_seed
        self.register_buffer("tid2eid", hash_table(vocab_size, num_experts, self.top_k, table_seed))
        self._token_ids_N: Tensor | None = None

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)

    def forward(
        self, x_BTD: Tensor, decode_state: DecodeState | None = None, token_ids_BT: Tensor | None = None
    ) -> Routing:
        """Route x [B, T, D] whose tokens have ids ``token_ids_BT`` (int [B, T], each below V)."""
        check_input(x_BTD, self.d_model)  # a malformed input is named before the missing ids
        if token_ids_BT is None:
            raise ValueError(
                "router 'hash' routes by token id: call it as router(x_BTD, token_ids_BT=ids) "
                "(MoELayer and MoETransformer pass the ids; a pipeline stage or a transformers block does not)"
            )
        if token_ids_BT.shape != x_BTD.shape[:2] or token_ids_BT.is_floating_point():
            raise ValueError(
                f"token_ids_BT must be integer ids of shape [B, T] = {tuple(x_BTD.shape[:2])}, "
                f"got {token_ids_BT.dtype} {tuple(token_ids_BT.shape)}"
            )
        self._token_ids_N = token_ids_BT.reshape(-1).long()
        try:
            return super().forward(x_BTD, decode_state)
        finally:
            self._token_ids_N = None

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        ids_N = self._token_ids_N
        if self.check_finite and ids_N.numel() and not bool(((ids_N >= 0) & (ids_N < self.vocab_size)).all()):
            raise ValueError(f"router 'hash': token ids must be in [0, vocab_size={self.vocab_size})")
        expert_NK = self.tid2eid[ids_N]
        return self.replay(logits_NE, x_BTD, batch_shape, expert_NK, decoding=False)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given experts weighted as :meth:`route` weights its table's (the gate's current
        scores at them, :meth:`TokenChoiceBase.combine_weights`): a replay of a recorded forward
        with unchanged weights is that forward bit for bit, and needs no token ids."""
        scores_NE = router_scores(logits_NE, self.gate_fn)
        weight_NK = self.combine_weights(logits_NE, scores_NE, expert_NK)
        return self.replayed_routing(logits_NE, scores_NE, expert_NK, weight_NK, batch_shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_size={self.vocab_size}, table_seed={self.table_seed}"


def block_router(router: str, router_options: dict, vocab_size: int, block: int, hashed: bool) -> tuple[str, dict]:
    """(router name, options) of MoE block ``block`` of a model: ``hash`` with the model's
    :data:`SHARED_OPTIONS` where ``hashed`` (``ModelConfig.hash_layers``), else the model's
    router. A hash router gets the model's vocabulary and the table seed ``table_seed + block``
    (``table_seed`` default 0), so that each hash block draws its own table."""
    if hashed:
        router, router_options = "hash", {k: v for k, v in router_options.items() if k in SHARED_OPTIONS}
    if router != "hash":
        return router, router_options
    seed = router_options.get("table_seed", 0) + block
    return router, {**router_options, "vocab_size": vocab_size, "table_seed": seed}
