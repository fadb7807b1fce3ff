"""Document expert pools (EMO, Ai2 2026; OLMo-core's ``EmoRouter``, PRs #704 / #801): the tokens of
one document route only among a pool of P of the E experts.

Shape legend: B sequences, T positions, N = B*T tokens, E experts, K top-k, P pool size.

Documents: a sequence starts one, and a token whose id is ``eos_token_id`` ends the document it
belongs to (the next token starts a new one), as OLMo-core derives ``document_boundaries`` from
the EOS id. The token ids reach the router as ``router(x_BTD, token_ids_BT=idx_BT)`` (``reads_token_ids``:
``MoELayer`` and ``MoETransformer`` pass their input ids, through the KV cache too); without them
(or without ``eos_token_id``) each sequence is one document.

A pool is the P experts of largest summed softmax probability (ties: the lower index), taken
from one of two sets of the document's tokens (``pool_from``):

* ``"document"`` (EMO): all its tokens. A token's pool then depends on the later tokens of its
  document: **not causal** in either mode, not decode-consistent (batch-invariant: a document
  never spans sequences).
* ``"prefix"`` (ours, causal): its first ``pool_prefix`` tokens up to the routed one. The token at
  document position i reads the probabilities of document positions 0..min(i, m-1) (m =
  ``pool_prefix``): the pool grows with the first m tokens, then stays fixed for the rest of the
  document. Causal, batch-invariant and decode-consistent in both modes; decoding keeps per
  sequence the running sum, the document position and whether the last token was an EOS.

Within its pool each token takes its top-k of the router's scores, computed on the logits with
the experts outside the pool at -inf (EMO masks the logits before its score function), weights
renormalised over the k as ``topk`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.checks import positive_int
from moe.routers.token_choice import TokenChoiceBase
from moe.routing import Claims, DecodeState, Routing, register_router, router_scores

POOL_FROM = ("document", "prefix")
"""``pool_from``: which tokens of a document choose its pool (see the module docstring)."""


@dataclass
class DocPoolState(DecodeState):
    """What ``pool_from="prefix"`` keeps between decoded chunks, per sequence."""

    running: Tensor | None = None
    """float [B, E]: the summed probabilities of the current document's first tokens (None: none yet)."""
    count: Tensor | None = None
    """int64 [B]: tokens of the current document routed so far."""
    after_eos: Tensor | None = None
    """bool [B]: the last routed token ended its document (True before the first token)."""


@register_router("doc_pool")
class DocumentPoolRouter(TokenChoiceBase):
    """Top-k within a per-document pool of experts (see the module docstring).

    Options: ``document_expert_pool`` P (OLMo-core's ``document_expert_pool``; default E // 2;
    ``EmoRouter`` draws it per document in training from ``[min_document_expert_pool,
    max_document_expert_pool]`` and uses ``eval_document_expert_pool`` at eval: one fixed P
    here), ``eos_token_id`` (OLMo-core's; None: each sequence is one document), ``pool_from``
    ("document" | "prefix"), ``pool_prefix`` m (16; "prefix" only), ``top_k`` (2, at most P, as
    EMO requires), and ``topk``'s score options. Grouped routing and a balance bias are refused,
    as OLMo-core's ``EmoRouterV2`` refuses them.
    """

    reads_token_ids = True

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        document_expert_pool: int | None = None,
        eos_token_id: int | None = None,
        pool_from: str = "prefix",
        pool_prefix: int = 16,
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, **options)
        pool = max(num_experts // 2, 1) if document_expert_pool is None else document_expert_pool
        positive_int("document_expert_pool", pool)
        if not self.top_k <= pool <= num_experts:
            raise ValueError(f"document_expert_pool={pool} must be in [top_k={self.top_k}, num_experts={num_experts}]")
        if pool_from not in POOL_FROM:
            raise ValueError(f"pool_from must be one of {', '.join(map(repr, POOL_FROM))}, got {pool_from!r}")
        positive_int("pool_prefix", pool_prefix)
        if self.num_expert_groups is not None or self.balance_rate > 0:
            raise ValueError("doc_pool routes within a document's pool: grouped routing and balance_rate are refused")
        self.pool, self.eos_token_id, self.pool_from, self.pool_prefix = pool, eos_token_id, pool_from, pool_prefix
        self._token_ids: Tensor | None = None

    @property
    def claims(self) -> Claims:
        causal = self.pool_from == "prefix"
        return Claims(causal_train=causal, causal_eval=causal, batch_invariant=True, decode_consistent=causal)

    def forward(
        self, x_BTD: Tensor, decode_state: DecodeState | None = None, token_ids_BT: Tensor | None = None
    ) -> Routing:
        """``token_ids_BT`` (int [B, T], optional): the ids of x's tokens, whose EOS ids end documents."""
        if token_ids_BT is not None and (
            token_ids_BT.is_floating_point() or tuple(token_ids_BT.shape) != tuple(x_BTD.shape[:2])
        ):
            raise ValueError(
                f"token_ids_BT must be integer ids of shape [B, T] = {list(x_BTD.shape[:2])}, "
                f"got {token_ids_BT.dtype} {list(token_ids_BT.shape)}"
            )
        self._token_ids = token_ids_BT
        try:
            return super().forward(x_BTD, decode_state)
        finally:
            self._token_ids = None

    def init_decode_state(self, batch_size: int) -> DocPoolState:
        base = super().init_decode_state(batch_size)
        return DocPoolState(base.batch_size, after_eos=torch.ones(batch_size, dtype=torch.bool))

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        return self._route(self.pooled_logits(logits_NE, batch_shape), batch_shape)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        return self._route(self.pooled_logits(logits_NE, batch_shape, state), batch_shape)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The recorded experts weighted as :meth:`route` weighs them: the scores of the logits
        masked to the token's current pool, renormalised over the recorded experts. A decoded
        chunk's pool lives in its decode state, which replay is not given: refused."""
        if decoding:
            raise ValueError("doc_pool replays full forwards only: a KV-cache chunk's pool is in its decode state")
        masked_NE = self.pooled_logits(logits_NE, batch_shape)
        scores_NE = router_scores(masked_NE, self.gate_fn)
        weight_NK = self.combine_weights(masked_NE, scores_NE, expert_NK)
        return self.replayed_routing(masked_NE, scores_NE, expert_NK, weight_NK, batch_shape)

    def _route(self, masked_NE: Tensor, batch_shape: tuple[int, int]) -> Routing:
        scores_NE, expert_NK, weight_NK = self.select(masked_NE)
        return self.replayed_routing(masked_NE, scores_NE, expert_NK, weight_NK, batch_shape)

    def pooled_logits(self, logits_NE: Tensor, batch_shape: tuple[int, int], state: DocPoolState | None = None):
        """float [N, E]: the logits, -inf outside each token's pool."""
        b, t = batch_shape
        probs_BTE = torch.softmax(logits_NE.detach(), dim=-1).view(b, t, -1)
        after_eos_B = torch.ones(b, dtype=torch.bool, device=logits_NE.device) if state is None else state.after_eos
        starts_BT = self.document_starts(after_eos_B.to(logits_NE.device), b, t)
        if self.pool_from == "document":
            score_BTE = document_sums(probs_BTE, starts_BT)
        else:
            score_BTE = self.prefix_sums(probs_BTE, starts_BT, state)
        order_NE = torch.argsort(score_BTE.reshape(b * t, -1), dim=-1, descending=True, stable=True)
        outside_NE = torch.ones_like(logits_NE, dtype=torch.bool).scatter_(1, order_NE[:, : self.pool], False)
        return logits_NE.masked_fill(outside_NE, float("-inf"))

    def document_starts(self, after_eos_B: Tensor, b: int, t: int) -> Tensor:
        """bool [B, T]: the positions that start a document (the first one iff ``after_eos_B``)."""
        starts_BT = torch.zeros(b, t, dtype=torch.bool, device=after_eos_B.device)
        starts_BT[:, 0] = after_eos_B
        ids_BT = self._token_ids
        if ids_BT is not None and self.eos_token_id is not None:
            starts_BT[:, 1:] = ids_BT[:, :-1] == self.eos_token_id
        return starts_BT

    def prefix_sums(self, probs_BTE: Tensor, starts_BT: Tensor, state: DocPoolState | None) -> Tensor:
        """float [B, T, E]: at each position, the summed probabilities of its document's first
        ``pool_prefix`` positions up to it, position by position (a decoded chunk continues the
        state's sums with the same additions, so it gets the full forward's bits)."""
        b, t, e = probs_BTE.shape
        running_BE = probs_BTE.new_zeros(b, e) if state is None or state.running is None else state.running
        count_B = (
            torch.zeros(b, dtype=torch.long, device=probs_BTE.device)
            if state is None or state.count is None
            else state.count
        )
        rows = []
        for i in range(t):
            start_B = starts_BT[:, i]
            running_BE = torch.where(start_B[:, None], torch.zeros_like(running_BE), running_BE)
            count_B = torch.where(start_B, torch.zeros_like(count_B), count_B)
            read_B1 = (count_B < self.pool_prefix)[:, None]
            running_BE = running_BE + torch.where(read_B1, probs_BTE[:, i], torch.zeros_like(running_BE))
            count_B = count_B + 1
            rows.append(running_BE)
        if state is not None:
            state.running, state.count = running_BE, count_B
            ids_BT = self._token_ids
            ended = ids_BT is not None and self.eos_token_id is not None
            state.after_eos = (
                ids_BT[:, -1] == self.eos_token_id if ended else torch.zeros_like(count_B, dtype=torch.bool)
            )
        return torch.stack(rows, 1)


def document_sums(probs_BTE: Tensor, starts_BT: Tensor) -> Tensor:
    """float [B, T, E]: at each position, the summed probabilities of every token of its document."""
    b, t, e = probs_BTE.shape
    doc_BT = starts_BT.long().cumsum(1) - 1 + torch.arange(b, device=probs_BTE.device).view(b, 1) * t
    sums_SE = probs_BTE.new_zeros(b * t, e).index_add_(0, doc_BT.reshape(-1), probs_BTE.reshape(b * t, e))
    return sums_SE[doc_BT]
