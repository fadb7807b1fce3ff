"""Expert-parallel dispatch and combine over a ``torch.distributed`` process group.

Shape legend: P ranks in the expert-parallel group, E experts in all, L = E/P local experts,
N local tokens, D model width, A local (token, expert) assignments, R rows this rank
receives (assignments of any rank that picked one of its experts).

Rank r holds experts [r*L, (r+1)*L). One forward on every rank of the group:

1. routing has already run on the rank's own N tokens (``token_A``, ``expert_A``, ``weight_A``);
2. assignments are sorted by expert (stable), so rows bound for rank p are contiguous;
3. ``all_to_all_single`` of the per-expert counts tells each rank how many rows it receives
   from every rank for each of its experts;
4. ``all_to_all_single`` with uneven splits sends the token rows; the local experts run on
   the R received rows through the layer's backend;
5. the reverse exchange returns the expert outputs to the ranks that own the tokens, which
   weight them and sum each token's rows in a fixed order (the same order as the
   single-process reference, so results agree to rounding).

Both row exchanges are autograd functions whose backward is the reverse exchange. A rank
that sends or receives no rows, or an expert with no rows, is an ordinary case: every rank
still joins every collective, with zero-length splits.

Rank-deduplicated dispatch (``ExpertParallel(group, dedup=True)``,
:func:`expert_parallel_ffn_dedup`): a token whose k experts live on m <= k ranks sends its
row once to each of those m ranks (with, per assignment, the row's index, the local expert
and the weight), the receiving rank sums the weighted outputs of its experts into one row
per token, and one row per (token, rank) comes back: U (token, rank) pairs travel instead of
A assignments, both ways. This is what makes group-limited routing (DeepSeek-V3's
node-limited routing; its DeepEP dispatch sends a token once per node) cheaper to exchange:
with the experts' groups mapped to ranks, m <= M. Results equal the per-assignment path to
rounding (each token's rows are summed per rank first).

Under ``torch.compile`` the exchange runs eagerly (``torch.compiler.disable``): the row
all-to-all needs its split sizes as Python integers, read from the token counts on the host,
so no graph can hold it; a block compiles into the graphs before and after it, with one
deliberate break, instead of Dynamo breaking at each host read with a report.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from causal_moe_kernels.reference import gather_rows, scatter_sum, sort_by_expert, token_slots
from moe.experts import SwiGLUExperts, resolve_backend
from moe.parallel.timing import PhaseTimer
from moe.routing import count_indices

T = TypeVar("T")


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank within ``group``, size of ``group``); ``None`` is the default (world) group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("expert parallelism needs torch.distributed initialised (torchrun + init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def local_expert_range(num_experts: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """[start, stop) of the experts this rank holds: a contiguous block of E/P experts."""
    rank, size = group_rank_size(group)
    if num_experts % size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel group size {size}; "
            f"every rank must hold the same number of experts (choose E a multiple of P)"
        )
    per_rank = num_experts // size
    return rank * per_rank, (rank + 1) * per_rank


def guarded(what: str, group: dist.ProcessGroup | None, fn: Callable[[], T]) -> T:
    """Run a collective; turn a backend failure (dead peer, timeout) into one clear error."""
    try:
        return fn()
    except RuntimeError as e:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        raise RuntimeError(
            f"expert-parallel {what} failed on rank {rank} of {size}: a peer process died or did not "
            f"answer within the process group's timeout. Backend error: {e}"
        ) from e


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send_splits`` go to ranks 0..P-1; rows arrive split by
    ``recv_splits``. The backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, x_SD: Tensor, recv_splits: list[int], send_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _all_to_all(x_SD.contiguous(), recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad_RD: Tensor):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad_RD.contiguous(), send_splits, recv_splits, ctx.group), None, None, None


def _all_to_all(x_SD: Tensor, recv_splits: list[int], send_splits: list[int], group) -> Tensor:
    out_RD = x_SD.new_empty(sum(recv_splits), *x_SD.shape[1:])
    guarded(
        "row exchange",
        group,
        lambda: dist.all_to_all_single(out_RD, x_SD, recv_splits, send_splits, group=group),
    )
    return out_RD


def all_to_all_rows(x_SD: Tensor, recv_splits: list[int], send_splits: list[int], group=None) -> Tensor:
    """Differentiable uneven all-to-all of rows: ``send_splits[p]`` rows of ``x`` go to rank p,
    ``recv_splits[p]`` rows come from rank p (concatenated in rank order)."""
    return _AllToAll.apply(x_SD, list(recv_splits), list(send_splits), group)


def exchange_counts(counts_E: Tensor, group=None) -> Tensor:
    """int64 [P, L]: entry [p, l] = rows rank p sends to this rank's local expert l, from
    every rank's per-expert counts ``counts_E`` (one ``all_to_all_single``)."""
    _, size = group_rank_size(group)
    recv = torch.empty_like(counts_E)
    guarded("count exchange", group, lambda: dist.all_to_all_single(recv, counts_E.contiguous(), group=group))
    return recv.view(size, -1)


def _local_block(experts: SwiGLUExperts, num_experts: int, group) -> tuple[int, int, int, int]:
    """(rank, size of ``group``, start, stop of this rank's experts); ValueError unless
    ``experts`` holds exactly that block."""
    rank, size = group_rank_size(group)
    start, stop = local_expert_range(num_experts, group)
    if experts.num_experts != stop - start:
        raise ValueError(
            f"rank {rank} holds {experts.num_experts} experts but E={num_experts} over {size} ranks "
            f"needs {stop - start} per rank"
        )
    return rank, size, start, stop


EAGER_UNDER_COMPILE = (
    "the token exchange runs eagerly between compiled graphs: its all-to-all split sizes are read on the host"
)
"""Why :func:`expert_parallel_ffn` is not compiled (the trainer says it once under ``--compile``)."""


@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)
def expert_parallel_ffn(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    experts: SwiGLUExperts,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    backend: str = "torch",
    timer: PhaseTimer | None = None,
) -> Tensor:
    """y[n] = sum over the assignments a of local token n: weight[a] * SwiGLU_{expert[a]}(x[n]),
    where ``experts`` holds only this rank's L = E/P experts and the others live on the other
    ranks of ``group``. Every rank of the group must call this in the same step (collective).

    ``expert_A`` holds global expert ids in [0, E). ``backend`` runs the local experts (see
    ``moe.experts.BACKENDS``). ``timer`` (benchmarks only) records the phases "dispatch",
    "exchange", "experts", "combine" in forward and marks their boundaries for backward.
    """
    _, size, start, stop = _local_block(experts, num_experts, group)
    n = x_ND.shape[0]
    phase = timer.phase if timer is not None else _no_phase
    mark = timer.mark if timer is not None else _no_mark
    with phase("dispatch"):
        order_A, counts_E = sort_by_expert(expert_A, num_experts)
        token_sorted_A = token_A[order_A]
        slot_A, num_slots = token_slots(token_sorted_A, n)
        send_AD = mark(gather_rows(x_ND, token_sorted_A, slot_A, num_slots), "dispatched")
    with phase("exchange"):
        recv_counts_PL = exchange_counts(counts_E, group)
        send_splits = counts_E.view(size, -1).sum(1).tolist()
        recv_splits = recv_counts_PL.sum(1).tolist()
        recv_RD = mark(all_to_all_rows(send_AD, recv_splits, send_splits, group), "received")
    with phase("experts"):
        r = recv_RD.shape[0]
        local_R = (
            torch.arange(stop - start, device=x_ND.device).repeat(size).repeat_interleave(recv_counts_PL.flatten())
        )
        ffn = resolve_backend(backend, x_ND.device)
        ones_R = torch.ones(r, dtype=recv_RD.dtype, device=recv_RD.device)
        arange_R = torch.arange(r, device=x_ND.device)
        weights = (experts.w_gate, experts.w_up, experts.w_down)
        if r > 0:
            y_RD = ffn(recv_RD, arange_R, local_R, ones_R, *weights)
        else:
            # No rows: keep the output attached to the inputs and weights anyway, so that the
            # backward still joins the reverse exchanges (the other ranks wait for them) and
            # the local experts get zero gradients, as in the single-process model.
            y_RD = recv_RD + sum(w.sum() for w in weights) * 0
        y_RD = mark(y_RD, "computed")
    with phase("exchange"):
        back_AD = mark(all_to_all_rows(y_RD, send_splits, recv_splits, group), "returned")
    with phase("combine"):
        weighted_AD = back_AD * weight_A[order_A].unsqueeze(-1).to(back_AD.dtype)
        y_ND = scatter_sum(weighted_AD, token_sorted_A, slot_A, num_slots, n)
    return y_ND


@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)
def expert_parallel_ffn_dedup(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    experts: SwiGLUExperts,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    backend: str = "torch",
) -> Tensor:
    """:func:`expert_parallel_ffn` with each token's row sent once per rank that holds one of
    its experts (see the module docstring): U = distinct (token, rank) pairs rows each way,
    plus two int64 and one weight per assignment. Collective: every rank of ``group`` calls it."""
    _, size, start, stop = _local_block(experts, num_experts, group)
    per_rank = stop - start
    n = x_ND.shape[0]
    dest_A = expert_A // per_rank
    order_S = torch.argsort(dest_A * n + token_A, stable=True)  # by destination, then token
    dest_S, token_S = dest_A[order_S], token_A[order_S]
    new_pair_S = torch.ones_like(dest_S, dtype=torch.bool)
    new_pair_S[1:] = (dest_S[1:] != dest_S[:-1]) | (token_S[1:] != token_S[:-1])
    pair_S = new_pair_S.long().cumsum(0) - 1
    pair_token_U, pair_dest_U = token_S[new_pair_S], dest_S[new_pair_S]
    pairs_P = count_indices(pair_dest_U, size)
    counts_P2 = torch.stack([pairs_P, count_indices(dest_S, size)], 1)
    recv_P2 = torch.empty_like(counts_P2)
    guarded("count exchange", group, lambda: dist.all_to_all_single(recv_P2, counts_P2, group=group))
    send_rows, send_assign = counts_P2[:, 0].tolist(), counts_P2[:, 1].tolist()
    recv_rows, recv_assign = recv_P2[:, 0].tolist(), recv_P2[:, 1].tolist()
    # per assignment: its pair's index within the destination's block, and the local expert
    first_pair_P = pairs_P.cumsum(0) - pairs_P
    meta_S2 = torch.stack([pair_S - first_pair_P[dest_S], expert_A[order_S] - dest_S * per_rank], 1)
    meta_R2 = _all_to_all(meta_S2, recv_assign, send_assign, group)
    slot_U, num_slots = token_slots(pair_token_U, n)
    rows_UD = all_to_all_rows(gather_rows(x_ND, pair_token_U, slot_U, num_slots), recv_rows, send_rows, group)
    weight_R = all_to_all_rows(weight_A[order_S].unsqueeze(1), recv_assign, send_assign, group).squeeze(1)
    source_R = torch.repeat_interleave(torch.arange(size, device=x_ND.device), recv_P2[:, 1])
    row_offset_P = recv_P2[:, 0].cumsum(0) - recv_P2[:, 0]
    row_R = meta_R2[:, 0] + row_offset_P[source_R]
    weights = (experts.w_gate, experts.w_up, experts.w_down)
    if rows_UD.shape[0] > 0:
        ffn = resolve_backend(backend, x_ND.device)
        y_UD = ffn(rows_UD, row_R, meta_R2[:, 1], weight_R.to(rows_UD.dtype), *weights)
    else:  # keep the backward joined to the reverse exchanges (see expert_parallel_ffn)
        y_UD = rows_UD + sum(w.sum() for w in weights) * 0 + weight_R.sum() * 0
    back_UD = all_to_all_rows(y_UD, send_rows, recv_rows, group)
    return scatter_sum(back_UD, pair_token_U, slot_U, num_slots, n)


class ExpertParallel:
    """The expert-parallel data path handed to an ``MoELayer`` (``moe.layer`` never imports
    this package): the process group the experts are split over and the dispatch ->
    exchange -> experts -> exchange -> combine path (:func:`expert_parallel_ffn`).

        ep = ExpertParallel(dist.group.WORLD)
        layer = MoELayer(512, 1024, 8, expert_parallel=ep)

    ``moe.parallel`` finds expert-parallel layers by this object (see
    ``moe.parallel.state.expert_parallel_layers``), never by their class. ``dedup=True`` sends
    a token's row once per rank holding one of its experts (:func:`expert_parallel_ffn_dedup`)
    instead of once per assignment. ``mesh`` (optional):
    the run's full DeviceMesh, whose ``"ep"`` dim is ``group``; sharded checkpoints describe
    the experts on it (``moe.parallel.sharded_state``).
    """

    def __init__(self, group: dist.ProcessGroup | None, mesh=None, dedup: bool = False) -> None:
        group_rank_size(group)  # a clear error when torch.distributed is not initialised
        if mesh is not None and "ep" not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"the mesh of an ExpertParallel needs an 'ep' dim, got {mesh.mesh_dim_names}")
        self.group = group
        self.mesh = mesh
        self.dedup = dedup

    def local_range(self, num_experts: int) -> tuple[int, int]:
        """[start, stop) of the experts this rank holds."""
        return local_expert_range(num_experts, self.group)

    def __call__(
        self,
        x_ND: Tensor,
        token_A: Tensor,
        expert_A: Tensor,
        weight_A: Tensor,
        experts: SwiGLUExperts,
        num_experts: int,
        backend: str = "torch",
        timer: PhaseTimer | None = None,
    ) -> Tensor:
        if self.dedup:
            if timer is not None:
                raise ValueError("the phase timer measures the per-assignment exchange only (dedup=False)")
            return expert_parallel_ffn_dedup(
                x_ND, token_A, expert_A, weight_A, experts, num_experts, self.group, backend
            )
        return expert_parallel_ffn(x_ND, token_A, expert_A, weight_A, experts, num_experts, self.group, backend, timer)

    def __repr__(self) -> str:
        rank, size = group_rank_size(self.group)
        return f"ExpertParallel(rank {rank} of {size})"


def _no_phase(name: str) -> nullcontext:
    return nullcontext()


def _no_mark(x: Tensor, name: str) -> Tensor:
    return x


BACKWARD_PHASES = [
    ("combine", "returned"),
    ("exchange", "computed"),
    ("experts", "received"),
    ("exchange", "dispatched"),
    ("dispatch", ""),
]
"""(phase, mark ending it) in backward order, for :meth:`PhaseTimer.backward_split`."""
