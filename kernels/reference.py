"""PyTorch reference for the MoE data path: dispatch -> grouped SwiGLU -> combine.

Shape legend: N tokens, D model width, F expert width, E experts, A assignments,
S = max assignments of one token (slots).

Deterministic on every device: no atomics. Rows are summed into tokens through a padded
[N, S, D] buffer reduced over S in slot order, and the backward of the gather uses the same
sum, so outputs and gradients are bitwise reproducible run to run.

Under ``torch.compile`` the sorted path cannot be traced without reading values on the host
(S, the per-expert slice lengths): :func:`moe_ffn_all_experts` computes the same y with
static shapes instead, and :func:`moe_ffn_reference` switches to it while being traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sort_by_expert(expert_A: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Stable sort of assignments by expert: (order_A, counts_E). Ties keep assignment order."""
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = torch.bincount(expert_A, minlength=num_experts)
    return order_A, counts_E


def token_slots(token_A: Tensor, num_tokens: int) -> tuple[Tensor, int]:
    """(slot_A, S): slot_A[a] is how many earlier assignments (in index order) share a's token."""
    if token_A.numel() == 0:
        return torch.zeros_like(token_A), 1
    order = torch.argsort(token_A, stable=True)
    counts_N = torch.bincount(token_A, minlength=num_tokens)
    starts_N = torch.cumsum(counts_N, 0) - counts_N
    slot_sorted = torch.arange(token_A.numel(), device=token_A.device) - starts_N[token_A[order]]
    slot_A = torch.empty_like(token_A)
    slot_A[order] = slot_sorted
    return slot_A, int(counts_N.max())


def scatter_sum(rows_AD: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int, num_tokens: int) -> Tensor:
    """[N, D]: out[n] = sum of the rows of token n, added in slot order (fixed, no atomics)."""
    buf_NSD = rows_AD.new_zeros(num_tokens, num_slots, rows_AD.shape[-1])
    buf_NSD = buf_NSD.index_put((token_A, slot_A), rows_AD)
    return buf_NSD.sum(1)


class _GatherRows(torch.autograd.Function):
    """x_ND[token_A] whose backward is the deterministic :func:`scatter_sum`."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int) -> Tensor:
        ctx.save_for_backward(token_A, slot_A)
        ctx.num_slots, ctx.num_tokens = num_slots, x_ND.shape[0]
        return x_ND.index_select(0, token_A)

    @staticmethod
    def backward(ctx, grad_AD: Tensor):
        token_A, slot_A = ctx.saved_tensors
        return scatter_sum(grad_AD, token_A, slot_A, ctx.num_slots, ctx.num_tokens), None, None, None


def gather_rows(x_ND: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int) -> Tensor:
    """[A, D]: the row of each assignment's token, with a deterministic backward."""
    return _GatherRows.apply(x_ND, token_A, slot_A, num_slots)


def grouped_swiglu(x_AD: Tensor, counts_E: list[int], w_gate_EDF: Tensor, w_up_EDF: Tensor, w_down_EFD: Tensor) -> Tensor:
    """Rows already sorted by expert; expert e's contiguous slice goes through its SwiGLU."""
    outs = []
    # unbind, not w[e]: each w[e]'s backward would materialise a zero [E, D, F] gradient
    for x_e, wg, wu, wd in zip(x_AD.split(counts_E), w_gate_EDF.unbind(0), w_up_EDF.unbind(0), w_down_EFD.unbind(0)):
        if x_e.shape[0] == 0:
            continue
        h = F.silu(x_e @ wg) * (x_e @ wu)
        outs.append(h @ wd)
    if not outs:
        return x_AD.new_zeros(0, w_down_EFD.shape[-1])
    return torch.cat(outs)


def moe_ffn_reference(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> Tensor:
    """y[n] = sum over assignments a of token n: weight[a] * SwiGLU_{expert[a]}(x[n]).

    Dispatch sorts assignments by expert (stable), the experts run on contiguous slices,
    combine sums each token's rows in a fixed order. Tokens with no assignment get zeros.
    """
    n, e = x_ND.shape[0], w_gate_EDF.shape[0]
    if token_A.numel() == 0:
        return x_ND.new_zeros(n, w_down_EFD.shape[-1])
    if torch.compiler.is_compiling():
        return moe_ffn_all_experts(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD)
    order_A, counts_E = sort_by_expert(expert_A, e)
    token_sorted_A = token_A[order_A]
    slot_A, num_slots = token_slots(token_sorted_A, n)
    x_AD = gather_rows(x_ND, token_sorted_A, slot_A, num_slots)
    y_AD = grouped_swiglu(x_AD, counts_E.tolist(), w_gate_EDF, w_up_EDF, w_down_EFD)
    weighted_AD = y_AD * weight_A[order_A].unsqueeze(-1).to(y_AD.dtype)
    return scatter_sum(weighted_AD, token_sorted_A, slot_A, num_slots, n)


def moe_ffn_all_experts(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> Tensor:
    """The y of :func:`moe_ffn_reference` with static shapes and no host read: every expert
    runs on every token, weighted by the dense [N, E] combine weights (zero where a token was
    not routed to an expert), summed over experts in expert order. It costs E/K times the
    expert FLOPs of the sorted path; a zero-weight row adds exactly nothing, in the output and
    in every gradient. Assignments must be distinct (token, expert) pairs, as every router
    of the package produces (and as the fixed-size routing form keeps them)."""
    n, e = x_ND.shape[0], w_gate_EDF.shape[0]
    w_NE = weight_A.new_zeros(n, e).index_put((token_A, expert_A), weight_A)
    h_ENF = F.silu(torch.matmul(x_ND, w_gate_EDF)) * torch.matmul(x_ND, w_up_EDF)
    y_END = torch.bmm(h_ENF, w_down_EFD)
    return (y_END * w_NE.T.unsqueeze(-1).to(y_END.dtype)).sum(0)
