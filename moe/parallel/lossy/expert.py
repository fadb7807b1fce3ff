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
is lost when any packet it overlaps is lost.

The backward runs the two exchanges in reverse, and their messages are lost too
(:class:`LossyExpertParallel`, the layer's expert-parallel path): the output gradient of a
surviving assignment travels from the token's owner to the expert's rank (the return
exchange's backward); lost, the expert sees a zero row, so neither the expert's weights nor
the token's input get that assignment's gradient (the combine weight's gradient, computed at
the owner from the output that did arrive, is kept). The input gradient travels back from
the expert's rank to the owner (the dispatch exchange's backward); lost, the token's input
misses that expert's share while the expert's weights keep theirs. Simulated at the owner,
where both messages start or end: the exchange's boundary hooks (the ``mark`` of
``expert_parallel_ffn``'s phase protocol) zero the lost rows of the gradient that leaves
(``returned``) and of the gradient that arrives (``dispatched``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from causal_moe_kernels.reference import sort_by_expert
from moe.parallel.exchange import ExpertParallel, expert_parallel_ffn, group_rank_size
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


def _lost_rows(counts_P: list[int], row_width: int, transport: LossyTransport, stream: int, outbound: bool) -> Tensor:
    """bool [A]: the rows of this rank's messages of ``stream`` that are lost, in expert-sorted
    order (``counts_P[p]`` rows for rank p's experts); ``outbound``: messages this rank -> p,
    else p -> this rank. A row is lost when any packet it overlaps is lost."""
    rank, _ = group_rank_size(transport.group)
    lost = [torch.zeros(0, dtype=torch.bool)]
    for p, rows in enumerate(counts_P):
        src, dst = (rank, p) if outbound else (p, rank)
        lost.append(transport.lost_elements(stream, src, dst, rows * row_width).view(rows, row_width).any(1))
    return torch.cat(lost)


def _rows_per_rank(expert_A: Tensor, num_experts: int, size: int) -> tuple[Tensor, list[int]]:
    """(order_A, counts_P): the stable sort by expert of the exchange and the rows of each rank's experts."""
    if num_experts % size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the group size {size}")
    order_A, counts_E = sort_by_expert(expert_A, num_experts)
    return order_A, counts_E.view(size, -1).sum(1).tolist()


def lost_assignments(expert_A: Tensor, num_experts: int, row_width: int, transport: LossyTransport) -> Tensor:
    """bool [A]: which assignments lose their row in the dispatch or their output on the way
    back. Takes two streams of ``transport`` (dispatch, return): every rank of its group
    calls this for the same exchange, in the same order."""
    _, size = group_rank_size(transport.group)
    order_A, counts_P = _rows_per_rank(expert_A, num_experts, size)
    dispatch, back = transport.next_stream(), transport.next_stream()
    lost_sorted_A = _lost_rows(counts_P, row_width, transport, dispatch, True) | _lost_rows(
        counts_P, row_width, transport, back, False
    )
    lost_A = torch.empty_like(lost_sorted_A)
    lost_A[order_A.cpu()] = lost_sorted_A
    return lost_A.to(expert_A.device)


class _LoseGradientRows(torch.autograd.Function):
    """Identity in forward; the backward zeroes the gradient rows ``lost_A`` (rows lost in transit)."""

    @staticmethod
    def forward(ctx, x_AD: Tensor, lost_A: Tensor) -> Tensor:
        ctx.save_for_backward(lost_A)
        return x_AD.view_as(x_AD)

    @staticmethod
    def backward(ctx, grad_AD: Tensor):
        (lost_A,) = ctx.saved_tensors
        return grad_AD.masked_fill(lost_A.unsqueeze(-1), 0.0), None


@dataclass
class LostGradientRows:
    """Boundary hooks for ``expert_parallel_ffn`` (its ``timer`` protocol: ``phase`` and
    ``mark``) that lose gradient rows of the backward exchanges (module docstring). Both masks
    are bool [A] over the exchange's rows in expert-sorted order."""

    returned_A: Tensor
    """Output-gradient rows lost on their way from this rank (the owner) to the expert's rank."""
    dispatched_A: Tensor
    """Input-gradient rows lost on their way from the expert's rank back to this rank."""

    def phase(self, name: str) -> nullcontext:
        return nullcontext()

    def mark(self, x_AD: Tensor, name: str) -> Tensor:
        lost_A = {"returned": self.returned_A, "dispatched": self.dispatched_A}.get(name)
        if lost_A is None or not x_AD.requires_grad:
            return x_AD
        return _LoseGradientRows.apply(x_AD, lost_A.to(x_AD.device))


class LossyExpertParallel(ExpertParallel):
    """The expert-parallel path of ``inner``'s group whose backward exchanges lose gradient rows
    over ``transport`` (module docstring): ``layer.expert_parallel = LossyExpertParallel(...)``.
    With gradients enabled each call takes two streams (return backward, dispatch backward);
    ``enabled=False`` (or no gradient) is the reliable path."""

    def __init__(self, inner: ExpertParallel, transport: LossyTransport):
        super().__init__(inner.group, inner.mesh)
        self.transport, self.enabled = transport, True

    def __call__(
        self,
        x_ND: Tensor,
        token_A: Tensor,
        expert_A: Tensor,
        weight_A: Tensor,
        experts,
        num_experts: int,
        backend: str = "torch",
        timer=None,
    ) -> Tensor:
        if timer is not None:
            raise ValueError("LossyExpertParallel uses the exchange's boundary hooks itself: no timer")
        if not (self.enabled and torch.is_grad_enabled()):
            return super().__call__(x_ND, token_A, expert_A, weight_A, experts, num_experts, backend)
        _, size = group_rank_size(self.group)
        _, counts_P = _rows_per_rank(expert_A, num_experts, size)
        returned, dispatched = self.transport.next_stream(), self.transport.next_stream()
        d = x_ND.shape[-1]
        hooks = LostGradientRows(
            _lost_rows(counts_P, d, self.transport, returned, True),
            _lost_rows(counts_P, d, self.transport, dispatched, False),
        )
        return expert_parallel_ffn(x_ND, token_A, expert_A, weight_A, experts, num_experts, self.group, backend, hooks)

    def __repr__(self) -> str:
        return f"Lossy{super().__repr__()}"


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

    def __init__(
        self, router: nn.Module, num_experts: int, row_width: int, transport: LossyTransport, renormalise: bool = False
    ):
        super().__init__()
        self.inner, self.num_experts, self.row_width = router, num_experts, row_width
        self.transport, self.renormalise, self.enabled = transport, renormalise, True

    def forward(self, x_BTD: Tensor, decode_state=None):
        routing = self.inner(x_BTD, decode_state=decode_state)
        if not self.enabled:
            return routing
        kept = drop_lost_assignments(
            routing.token,
            routing.expert,
            routing.weight,
            routing.num_tokens,
            self.num_experts,
            self.row_width,
            self.transport,
            self.renormalise,
        )
        before = max(routing.token.numel(), 1)
        served = (1.0 - routing.stats["dropped_fraction"].float()) * (kept.token_A.numel() / before)
        stats = {
            **routing.stats,
            "tokens_per_expert": count_indices(kept.expert_A, self.num_experts),
            "dropped_fraction": 1.0 - served,
            "ep_lost_fraction": torch.tensor(kept.lost_fraction),
        }
        return replace(routing, token=kept.token_A, expert=kept.expert_A, weight=kept.weight_A, stats=stats)


def wrap_expert_parallel_routers(
    model: nn.Module, transport: LossyTransport, renormalise: bool = False, gradients: bool = True
) -> list[LossyRouter | LossyExpertParallel]:
    """Wrap the router of every expert-parallel ``MoELayer`` of ``model`` in a :class:`LossyRouter`
    (parameter names gain ``.inner``) and, with ``gradients``, its expert-parallel path in a
    :class:`LossyExpertParallel` (the backward exchanges lose rows too). Returns the wrappers
    (each has ``enabled``)."""
    wrappers: list[LossyRouter | LossyExpertParallel] = []
    for layer in expert_parallel_layers(model).values():
        if isinstance(layer.router, LossyRouter) or isinstance(layer.expert_parallel, LossyExpertParallel):
            raise ValueError("the layer is wrapped already")
        layer.router = LossyRouter(layer.router, layer.num_experts, layer.d_model, transport, renormalise)
        wrappers.append(layer.router)
        if gradients:
            layer.expert_parallel = LossyExpertParallel(layer.expert_parallel, transport)
            wrappers.append(layer.expert_parallel)
    return wrappers
