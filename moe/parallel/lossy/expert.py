"""Expert-parallel traffic under packet loss: a lost row is a dropped assignment.

Shape legend: P ranks in the expert-parallel group, E experts, L = E/P local experts, A local
(token, expert) assignments, N local tokens, D model width (a row's elements).

In :func:`moe.parallel.expert_parallel_ffn` rank r sends rank p, in one message, the token rows
of its assignments to p's experts (sorted by expert, stable), and p sends the expert outputs
back in the same order. A row lost on the way there (the expert never sees it) or on the way
back (its output never arrives) leaves the token's output without that expert's weighted
contribution: exactly what a capacity drop does, and handled the same way: the assignment is
removed, the block's residual passes through for its share, and the routing statistics count
it. ``renormalise`` instead rescales the surviving assignments of each token so that its
combine weights keep their sum (a token that lost every assignment stays dropped).

:class:`LossyRouter` wraps a layer's router so that ``MoELayer`` (unchanged) runs on the
surviving assignments; :func:`wrap_expert_parallel_routers` does it for every expert-parallel
layer of a model.

Simulation: the loss pattern of both messages is a pure function (``LossyTransport``), so
the owner of the tokens removes the lost assignments before the exchange and
``expert_parallel_ffn`` runs on the survivors: the same output as sending every row and
discarding the lost ones at the receiver, with no communication added. A row of D elements
is lost when any packet it overlaps is lost. Losses in the backward exchanges are not
simulated (a dropped assignment simply has no gradient path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kernels.reference import sort_by_expert
from moe.parallel.exchange import group_rank_size
from moe.parallel.lossy.transport import LossyTransport
from moe.parallel.state import expert_parallel_layers
from moe.routing import count_indices


@dataclass
class LossyAssignments:
    """What :func:`drop_lost_assignments` returns: the surviving assignments and a count."""

    token_A: Tensor
    expert_A: Tensor
    weight_A: Tensor
    lost_A: Tensor
    """bool, over the input assignments: lost in the dispatch or on the way back."""
    lost_fraction: float
    """Fraction of this rank's assignments that were lost (0 when it has none)."""


def lost_assignments(expert_A: Tensor, num_experts: int, row_width: int, transport: LossyTransport) -> Tensor:
    """bool [A]: which assignments lose their row in the dispatch or their output on the way
    back. Takes two streams of ``transport`` (dispatch, return): every rank of its group
    calls this for the same exchange, in the same order."""
    rank, size = group_rank_size(transport.group)
    if num_experts % size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the group size {size}")
    dispatch, back = transport.next_stream(), transport.next_stream()
    order_A, counts_E = sort_by_expert(expert_A, num_experts)
    lost_sorted_A = torch.zeros(expert_A.numel(), dtype=torch.bool)
    start = 0
    for dst, rows in enumerate(counts_E.view(size, -1).sum(1).tolist()):
        if rows:
            there = transport.lost_elements(dispatch, rank, dst, rows * row_width).view(rows, row_width).any(1)
            home = transport.lost_elements(back, dst, rank, rows * row_width).view(rows, row_width).any(1)
            lost_sorted_A[start : start + rows] = there | home
        start += rows
    lost_A = torch.empty_like(lost_sorted_A)
    lost_A[order_A.cpu()] = lost_sorted_A
    return lost_A.to(expert_A.device)


def drop_lost_assignments(
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    num_tokens: int,
    num_experts: int,
    row_width: int,
    transport: LossyTransport,
    renormalise: bool = False,
) -> LossyAssignments:
    """The assignments that survive the expert-parallel exchange (module docstring), to pass to
    ``expert_parallel_ffn`` in place of the router's. ``renormalise`` rescales each token's
    surviving weights by (sum of all its weights) / (sum of its surviving weights)."""
    lost_A = lost_assignments(expert_A, num_experts, row_width, transport)
    keep_A = ~lost_A
    weight_kept_A = weight_A[keep_A]
    if renormalise:
        total_N = torch.zeros(num_tokens, dtype=weight_A.dtype, device=weight_A.device).index_add(0, token_A, weight_A)
        kept_N = torch.zeros_like(total_N).index_add(0, token_A[keep_A], weight_kept_A)
        scale_N = total_N / torch.where(kept_N != 0, kept_N, torch.ones_like(kept_N))
        weight_kept_A = weight_kept_A * scale_N[token_A[keep_A]]
    frac = float(lost_A.float().mean()) if lost_A.numel() else 0.0
    return LossyAssignments(token_A[keep_A], expert_A[keep_A], weight_kept_A, lost_A, frac)


class LossyRouter(nn.Module):
    """A router whose routing loses the assignments the expert-parallel exchange would lose:
    ``MoELayer.router = LossyRouter(layer.router, ...)``. The returned Routing holds the
    survivors; its stats gain ``ep_lost_fraction`` and count the lost assignments in
    ``dropped_fraction`` and ``tokens_per_expert``, as capacity drops are. ``enabled=False``
    passes the inner routing through (e.g. for evaluation)."""

    def __init__(self, router: nn.Module, num_experts: int, row_width: int, transport: LossyTransport,
                 renormalise: bool = False):
        super().__init__()
        self.inner, self.num_experts, self.row_width = router, num_experts, row_width
        self.transport, self.renormalise, self.enabled = transport, renormalise, True

    def forward(self, x_BTD: Tensor, decode_state=None):
        routing = self.inner(x_BTD, decode_state=decode_state)
        if not self.enabled:
            return routing
        kept = drop_lost_assignments(routing.token, routing.expert, routing.weight, routing.num_tokens,
                                     self.num_experts, self.row_width, self.transport, self.renormalise)
        before = max(routing.token.numel(), 1)
        served = (1.0 - routing.stats["dropped_fraction"].float()) * (kept.token_A.numel() / before)
        stats = {**routing.stats, "tokens_per_expert": count_indices(kept.expert_A, self.num_experts),
                 "dropped_fraction": 1.0 - served, "ep_lost_fraction": torch.tensor(kept.lost_fraction)}
        return replace(routing, token=kept.token_A, expert=kept.expert_A, weight=kept.weight_A, stats=stats)


def wrap_expert_parallel_routers(model: nn.Module, transport: LossyTransport, renormalise: bool = False) -> list[LossyRouter]:
    """Wrap the router of every expert-parallel ``MoELayer`` of ``model`` in a :class:`LossyRouter`
    (parameter names gain ``.inner``). Returns the wrappers."""
    wrappers = []
    for layer in expert_parallel_layers(model).values():
        layer.router = LossyRouter(layer.router, layer.num_experts, layer.d_model, transport, renormalise)
        wrappers.append(layer.router)
    return wrappers
