"""Capacity-limited token choice: top-k per token, then each expert keeps at most C
assignments per group and drops the rest.

Shape legend: B batch, T sequence, N = B*T tokens, E experts, K top-k, C capacity, A assignments.

Who keeps a slot is set by ``priority``:

* ``"position"``: slots are granted in position order, each token's k choices interleaved
  (token t's second choice ranks before token t+1's first). Whether token t keeps a slot then
  depends only on tokens <= t: causal. With ``group="batch"`` the order is time-major over
  the batch ((t, b) lexicographic), still causal in time but a sample's drops depend on the
  other samples.
* ``"score"``: batch-prioritised routing (BPR): the highest router scores keep their slots.
  A later token with a high score evicts an earlier one: *not causal*.
* ``"choice"``: GShard-style: every token's first choice is queued before any second choice
  (position order within a choice rank). A later token's first choice evicts an earlier
  token's second choice: *not causal*. Kept because several libraries ship it.

C = ceil(capacity_factor * group_size * K / E); ``capacity_factor=float("inf")`` never drops
and equals ``topk``.

``capacity_scope`` says which group size sets C. ``"group"`` (the usual choice) uses the
whole group, so C depends on T: routing the prefix 0..t alone (as decoding does) grants fewer
slots than the full sequence did, and a causal router still behaves differently at
inference. ``"prefix"`` (position priority only) gives the assignment at position t the
capacity of the prefix 0..t, ``C_t = ceil(capacity_factor * (t+1) * K / E)`` per sequence
(``(t+1) * B`` tokens with ``group="batch"``): an assignment keeps its slot iff fewer than
``C_t`` earlier assignments to that expert were kept. The decisions are the same whether the
sequence is routed whole or prefix by prefix, so training sees exactly what decoding sees.
Vectorised with the identity for a counter capped by a non-decreasing ceiling: starting from
k_0 kept, after the r-th request kept = r + min(k_0, min over requests s <= r of (C_s - s)).

Decoding (``capacity_scope="prefix"`` only): the decode state holds each group's per-expert
kept counts (``kept_GE``: G = B for ``group="sequence"``, 1 for ``group="batch"``) and the
position; a new chunk continues the counters from there.

Under ``torch.compile`` the router returns the fixed-size form of :class:`moe.routing.Routing`
(all N*K candidates, ``valid`` marking the kept ones, weight 0 on the dropped): the number
kept depends on the data, and a traced graph needs static shapes and no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.routers.token_choice import TokenChoiceBase
from moe.routing import (
    Claims,
    DecodeState,
    Routing,
    capacity_per_group,
    rank_within_segments,
    register_router,
    sort_into_segments,
)


@dataclass
class CapacityDecodeState(DecodeState):
    """Decode state of a prefix-scoped capacity router."""

    kept_GE: Tensor | None = None
    """int64 [G, E]: assignments kept so far per group (sequence b, or the whole batch) and expert."""


def kept_under_ceiling(
    segment_A: Tensor, priority_A: Tensor, ceiling_A: Tensor, start_A: Tensor | None = None
) -> Tensor:
    """bool [A]: walking each segment in priority order, keep an assignment iff the number kept
    so far is below its ceiling (non-decreasing along the walk). ``start_A``: the count already
    kept in the segment of each assignment before this walk (default 0; at most the ceilings).
    No Python loop: with r the 1-based request count and ceilings taken relative to the start,
    kept_r - start = r + min(0, cummin_s (ceiling_s - start - s)), per segment."""
    order_S, is_start_S, rank_S = sort_into_segments(segment_A, priority_A)
    requests_S = rank_S + 1
    rel_ceiling_A = ceiling_A if start_A is None else ceiling_A - start_A
    # a ceiling above the number of requests keeps everything, like that number: this bounds
    # the values for the shift below
    rel_ceiling_S = rel_ceiling_A[order_S].clamp_max(order_S.numel())
    # a segmented cummin: shifting each later segment far below the earlier ones resets it
    shift_S = torch.cumsum(is_start_S.long(), 0) * (2 * order_S.numel() + 2)
    slack_S = torch.cummin(rel_ceiling_S - requests_S - shift_S, dim=0).values + shift_S
    kept_count_S = requests_S + slack_S.clamp_max(0)
    before_S = torch.where(is_start_S, torch.zeros_like(kept_count_S), kept_count_S.roll(1))
    keep_A = torch.empty_like(is_start_S)
    keep_A[order_S] = kept_count_S > before_S
    return keep_A


@register_router("capacity")
class CapacityRouter(TokenChoiceBase):
    """Token choice with capacity and token dropping.

    Options: everything of ``topk`` plus ``capacity_factor`` (> 0, default 1.25),
    ``priority`` ("position" | "score" | "choice"), ``group`` ("sequence" | "batch"),
    ``capacity_scope`` ("group" | "prefix").
    Claims: causal in both modes iff ``priority="position"``; batch-invariant iff
    ``group="sequence"``; decode-consistent iff ``capacity_scope="prefix"``. Combine weights
    are normalised over the k choices *before* dropping, so a dropped choice simply loses its
    share.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        capacity_factor: float = 1.25,
        priority: str = "position",
        group: str = "sequence",
        capacity_scope: str = "group",
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, **options)
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if priority not in ("position", "score", "choice"):
            raise ValueError(f"priority must be 'position', 'score' or 'choice', got {priority!r}")
        if group not in ("sequence", "batch"):
            raise ValueError(f"group must be 'sequence' or 'batch', got {group!r}")
        if capacity_scope not in ("group", "prefix"):
            raise ValueError(f"capacity_scope must be 'group' or 'prefix', got {capacity_scope!r}")
        if capacity_scope == "prefix" and priority != "position":
            raise ValueError(
                "capacity_scope='prefix' needs priority='position' (other priorities read the future anyway)"
            )
        self.capacity_factor = float(capacity_factor)
        self.capacity_scope = capacity_scope
        self.priority = priority
        self.group = group

    @property
    def claims(self) -> Claims:
        causal = self.priority == "position"
        return Claims(
            causal_train=causal,
            causal_eval=causal,
            batch_invariant=self.group == "sequence",
            decode_consistent=self.capacity_scope == "prefix",
        )

    def init_decode_state(self, batch_size: int) -> CapacityDecodeState:
        """Position 0 and no kept assignments, per sequence (``group="sequence"``) or for the batch."""
        state = super().init_decode_state(batch_size)
        g = batch_size if self.group == "sequence" else 1
        kept_GE = torch.zeros(g, self.num_experts, dtype=torch.long, device=self.gate.weight.device)
        return CapacityDecodeState(state.batch_size, kept_GE=kept_GE)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        return self._route(logits_NE, batch_shape, None)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        return self._route(logits_NE, batch_shape, state)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given experts kept, nothing dropped. The record holds the kept experts only, so
        their weights are taken beside the token's current top-k choices, before drops as in
        :meth:`route` (a dropped choice keeps its share; see
        :meth:`~moe.routers.token_choice.TokenChoiceBase.weights_beside_choices`); the aux
        losses are a forward's (they count the current top-k whatever was kept). A decode
        state's kept counts are left as they were."""
        scores_NE, weight_NK = self.weights_beside_choices(logits_NE, expert_NK)
        routing = self.replayed_routing(logits_NE, scores_NE, expert_NK, weight_NK, batch_shape)
        group_size = batch_shape[1] if self.group == "sequence" else logits_NE.shape[0]
        capacity = capacity_per_group(self.capacity_factor, group_size, self.top_k, self.num_experts)
        routing.stats["capacity"] = torch.full((), capacity, device=logits_NE.device)
        return routing

    def _route(self, logits_NE: Tensor, batch_shape: tuple[int, int], state: CapacityDecodeState | None) -> Routing:
        """Route B sequences of T tokens; with ``state`` (prefix scope only) they are positions
        ``state.position ...`` and the kept counts continue from (and update) ``state.kept_GE``."""
        b, t = batch_shape
        n, e, k = logits_NE.shape[0], self.num_experts, self.top_k
        dev = logits_NE.device
        scores_NE, expert_NK, weight_NK = self.select(logits_NE)

        # Candidate assignments in token-major order: a = n*K + j.
        expert_A = expert_NK.reshape(-1)
        token_A = torch.arange(n, device=dev).repeat_interleave(k)
        choice_A = torch.arange(k, device=dev).repeat(n)
        b_A, t_A = token_A // t, token_A % t
        if self.group == "sequence":
            segment_A, group_size = b_A * e + expert_A, t
        else:
            segment_A, group_size = expert_A, n
        if self.priority == "position":
            if self.group == "sequence":
                priority_A = (t_A * k + choice_A).double()
            else:
                priority_A = ((t_A * b + b_A) * k + choice_A).double()
        elif self.priority == "choice":
            priority_A = (choice_A * n + t_A * b + b_A).double()
        else:
            priority_A = -scores_NE.detach().gather(1, expert_NK).reshape(-1).double()

        capacity = capacity_per_group(self.capacity_factor, group_size, k, e)
        if self.capacity_scope == "group":
            keep_A = rank_within_segments(segment_A, priority_A) < capacity
        else:
            # the capacity of the prefix 0..t: tokens that precede (or share) absolute position t
            position = 0 if state is None else state.position
            prefix_A = (t_A + position + 1) * (1 if self.group == "sequence" else b)
            ceiling_A = capacity_per_group(self.capacity_factor, prefix_A, k, e)
            # segment ids b*E + e (sequence) or e (batch) index the flattened kept_GE directly
            start_A = None if state is None else state.kept_GE.view(-1)[segment_A]
            keep_A = kept_under_ceiling(segment_A, priority_A, ceiling_A, start_A)
            if state is not None:
                state.kept_GE.view(-1).index_add_(0, segment_A, keep_A.long())
        weight_A = weight_NK.reshape(-1)
        if torch.compiler.is_compiling():
            # a data-dependent A cannot be traced: the fixed-size form lists every candidate
            valid_A, weight_A = keep_A, torch.where(keep_A, weight_A, 0.0)
        else:
            valid_A, token_A, expert_A, weight_A = None, token_A[keep_A], expert_A[keep_A], weight_A[keep_A]
        self.record_load(expert_A, valid_A)
        stats = self._stats(expert_A, n * k, valid_A)
        stats["capacity"] = torch.full((), capacity, device=dev)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_A,
            num_tokens=n,
            num_experts=e,
            aux_loss=self.token_choice_aux_loss(logits_NE, scores_NE, batch_shape),
            stats=stats,
            batch_shape=batch_shape,
            valid=valid_A,
        )
