"""PyTorch reference for the MoE data path: dispatch -> grouped SwiGLU -> combine.

Shape legend: N tokens, D model width, F expert width, E experts, A assignments,
S = max assignments of one token (slots).

Deterministic on every device: no atomics. Rows are summed into tokens through an [N, S, D]
layout reduced over S in slot order (a gather when every token has S rows, as in dropless
top-k; a zero-padded buffer otherwise), and the backward of the gather uses the same sum, so
outputs and gradients are bitwise reproducible run to run.

Under ``torch.compile`` the sorted path cannot be traced without reading values on the host
(S and the per-expert slice lengths size its tensors), so while traced
:func:`moe_ffn_reference` calls the same computation as one opaque operator,
``torch.ops.causal_moe_kernels.sorted_moe_ffn``, whose output shape [N, D] is known from its inputs: the
graph holds no data-dependent shape and no host read and the expert FLOPs are those of the
sorted path. The operator returns, besides y, what its backward (a second operator, the same
sums written out, expert by expert as eager autograd runs them) needs: the gathered rows
[A, D], what eager autograd saves of the SwiGLU (the gate and up projections, the gate's silu
and the product, [A, F] each), the expert rows [A, D] and the layout (sort order and slots),
so the backward neither sorts, gathers nor recomputes. These are marked
non-differentiable and get no zero-filled gradients.
"""

from __future__ import annotations

import functools
import itertools

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
    """[N, D]: out[n] = sum of the rows of token n, added in slot order (fixed, no atomics).

    The sum is that of a zero-padded [N, S, D] layout reduced over S in slot order: a token
    with fewer than S rows gets zeros added after its last row. When every token has
    ``num_slots`` rows (dropless top-k), the rows are a permutation of the [N, S] slots: one
    gather lays them out. Otherwise (:func:`_ragged_sum`) the same sums are formed without
    the padded buffer."""
    a, d = rows_AD.shape
    if a != num_tokens * num_slots:
        return _ragged_sum(rows_AD, token_A, slot_A, num_slots, num_tokens)
    inverse_P = torch.empty_like(token_A)
    inverse_P[token_A * num_slots + slot_A] = torch.arange(a, device=token_A.device)
    rows_NSD = rows_AD.index_select(0, inverse_P).view(num_tokens, num_slots, d)
    return functools.reduce(torch.add, rows_NSD.unbind(1))


def _ragged_sum(rows_AD: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int, num_tokens: int) -> Tensor:
    """:func:`scatter_sum` of tokens with 0..S rows, bit for bit the padded layout's sums, in
    O(A D) instead of O(N S D) (a third of the time at the study's large expert-threshold
    shape: N 768, D 256, S 4-6).

    Tokens ranked by their number of rows (most first), so the tokens with a row in slot s are
    ranks 0..m_s-1; the rows in slot-major, rank order; then slot by slot the first m_s ranks
    add their slot-s row, in place, the additions the padded layout makes. Where it added
    zeros instead, a single + 0.0 stands for them: x + 0 is x except that -0 becomes +0."""
    d = rows_AD.shape[1]
    order_N = torch.argsort(torch.bincount(token_A, minlength=num_tokens), descending=True, stable=True)
    rank_N = torch.empty_like(order_N)
    rank_N[order_N] = torch.arange(num_tokens, device=order_N.device)
    rows_PD = rows_AD.index_select(0, torch.argsort(slot_A * num_tokens + rank_N[token_A]))
    filled_S = torch.bincount(slot_A, minlength=num_slots).tolist()  # m_s: tokens with a slot-s row
    out_ND = rows_AD.new_zeros(num_tokens, d)
    out_ND[: filled_S[0]] = rows_PD[: filled_S[0]]
    start = filled_S[0]
    for m in filled_S[1:]:
        out_ND[:m] += rows_PD[start : start + m]
        start += m
    out_ND[filled_S[-1] : filled_S[0]] += 0.0
    return out_ND.index_select(0, rank_N)


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


def combine_backward(grad_ND: Tensor, rows_AD: Tensor, weight_A: Tensor, token_A: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_rows_AD, grad_weight_A) of :func:`combine_rows`: the gradient of each row is its
    token's output gradient (a gather) times its weight."""
    grad_rows_AD = grad_ND.index_select(0, token_A)
    grad_weight_A = (grad_rows_AD * rows_AD).sum(-1).to(weight_A.dtype)
    return grad_rows_AD.mul_(weight_A.unsqueeze(-1).to(grad_rows_AD.dtype)), grad_weight_A


def weighted_sum(
    rows_AD: Tensor, weight_A: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int, num_tokens: int
) -> Tensor:
    """[N, D]: each token's rows times their weights, summed in slot order (fixed, no atomics)."""
    return scatter_sum(rows_AD * weight_A.unsqueeze(-1).to(rows_AD.dtype), token_A, slot_A, num_slots, num_tokens)


class _CombineRows(torch.autograd.Function):
    """:func:`weighted_sum` with its backward written out (one gather, no zero buffers)."""

    @staticmethod
    def forward(ctx, rows_AD, weight_A, token_A, slot_A, num_slots: int, num_tokens: int) -> Tensor:
        ctx.save_for_backward(rows_AD, weight_A, token_A)
        return weighted_sum(rows_AD, weight_A, token_A, slot_A, num_slots, num_tokens)

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        return *combine_backward(grad_ND, *ctx.saved_tensors), None, None, None, None


def combine_rows(
    rows_AD: Tensor, weight_A: Tensor, token_A: Tensor, slot_A: Tensor, num_slots: int, num_tokens: int
) -> Tensor:
    """:func:`weighted_sum`, differentiable in the rows and the weights."""
    return _CombineRows.apply(rows_AD, weight_A, token_A, slot_A, num_slots, num_tokens)


def grouped_swiglu(
    x_AD: Tensor, counts_E: list[int], w_gate_EDF: Tensor, w_up_EDF: Tensor, w_down_EFD: Tensor
) -> Tensor:
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
    if torch.compiler.is_compiling():  # first: A may be a size only known at run time (nonzero's)
        return torch.ops.causal_moe_kernels.sorted_moe_ffn(
            x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD
        )[0]
    if token_A.numel() == 0:
        return x_ND.new_zeros(x_ND.shape[0], w_down_EFD.shape[-1])
    n = x_ND.shape[0]
    order_A, counts, token_sorted_A, slot_A, num_slots = _sorted_layout(token_A, expert_A, n, w_gate_EDF.shape[0])
    x_AD = gather_rows(x_ND, token_sorted_A, slot_A, num_slots)
    y_AD = grouped_swiglu(x_AD, counts, w_gate_EDF, w_up_EDF, w_down_EFD)
    return combine_rows(y_AD, weight_A[order_A], token_sorted_A, slot_A, num_slots, n)


def _sorted_layout(token_A: Tensor, expert_A: Tensor, num_tokens: int, num_experts: int):
    """(order_A, counts_E as a list, token_sorted_A, slot_A, S) of the sorted path."""
    order_A, counts_E = sort_by_expert(expert_A, num_experts)
    token_sorted_A = token_A[order_A]
    slot_A, num_slots = token_slots(token_sorted_A, num_tokens)
    return order_A, counts_E.tolist(), token_sorted_A, slot_A, num_slots


@torch.library.custom_op("causal_moe_kernels::sorted_moe_ffn", mutates_args=())
def _moe_ffn_op(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y_ND, x_AD, gate_AF, silu_AF, up_AF, h_AF, rows_AD, order_A, slot_A) of the sorted path,
    rows in expert order: y and what its backward needs (what eager autograd saves: the
    gate, its silu, the up projection and their product), the layout included, so nothing is
    sorted or recomputed twice. Each expert's products are written into its rows of [A, *]
    buffers (no per-expert temporaries, no concatenation)."""
    n, e = x_ND.shape[0], w_gate_EDF.shape[0]
    order_A, counts, token_sorted_A, slot_A, num_slots = _sorted_layout(token_A, expert_A, n, e)
    x_AD = x_ND.index_select(0, token_sorted_A)
    gate_AF, silu_AF, up_AF, h_AF = (x_AD.new_empty(x_AD.shape[0], w_gate_EDF.shape[-1]) for _ in range(4))
    rows_AD = x_AD.new_empty(x_AD.shape[0], w_down_EFD.shape[-1])
    for rows, wg, wu, wd in zip(_expert_rows(counts), w_gate_EDF.unbind(0), w_up_EDF.unbind(0), w_down_EFD.unbind(0)):
        torch.mm(x_AD[rows], wg, out=gate_AF[rows])
        torch.mm(x_AD[rows], wu, out=up_AF[rows])
        torch.ops.aten.silu.out(gate_AF[rows], out=silu_AF[rows])
        torch.mul(silu_AF[rows], up_AF[rows], out=h_AF[rows])
        torch.mm(h_AF[rows], wd, out=rows_AD[rows])
    y_ND = weighted_sum(rows_AD, weight_A[order_A], token_sorted_A, slot_A, num_slots, n)
    return y_ND, x_AD, gate_AF, silu_AF, up_AF, h_AF, rows_AD, order_A, slot_A


def _expert_rows(counts_E: list[int]) -> list[slice]:
    """Each expert's rows of the expert-sorted order (an empty slice for an expert with none)."""
    ends = list(itertools.accumulate(counts_E))
    return [slice(end - c, end) for c, end in zip(counts_E, ends)]


@_moe_ffn_op.register_fake
def _moe_ffn_fake(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD):
    a, f = token_A.shape[0], w_gate_EDF.shape[-1]
    return (
        x_ND.new_empty(x_ND.shape[0], w_down_EFD.shape[-1]),
        x_ND.new_empty(a, x_ND.shape[1]),
        *(x_ND.new_empty(a, f) for _ in range(4)),
        x_ND.new_empty(a, w_down_EFD.shape[-1]),
        token_A.new_empty(a),
        token_A.new_empty(a),
    )


@torch.library.custom_op("causal_moe_kernels::sorted_moe_ffn_backward", mutates_args=())
def _moe_ffn_backward_op(
    grad_ND: Tensor,
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
    x_AD: Tensor,
    gate_AF: Tensor,
    silu_AF: Tensor,
    up_AF: Tensor,
    h_AF: Tensor,
    rows_AD: Tensor,
    order_A: Tensor,
    slot_A: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of y w.r.t. (x, weight, w_gate, w_up, w_down): the SwiGLU backward per expert
    slice (autograd's own ``silu_backward``, the products eager autograd forms, written into
    [A, *] buffers), the gradient of x summed per token in slot order as the eager path does.
    The layout (order, slots) and the activations come from the forward."""
    counts = torch.bincount(expert_A, minlength=w_gate_EDF.shape[0]).tolist()
    token_sorted_A = token_A[order_A]
    grad_rows_AD, grad_weight_sorted_A = combine_backward(grad_ND, rows_AD, weight_A[order_A], token_sorted_A)
    grad_weight_A = torch.empty_like(grad_weight_sorted_A)
    grad_weight_A[order_A] = grad_weight_sorted_A
    dh_AF, du_AF, dg_AF = (torch.empty_like(gate_AF) for _ in range(3))
    dx_AD = torch.empty_like(x_AD)
    grad_gate, grad_up, grad_down = (w.new_empty(w.shape) for w in (w_gate_EDF, w_up_EDF, w_down_EFD))
    for e, rows in enumerate(_expert_rows(counts)):
        wg, wu, wd = w_gate_EDF[e], w_up_EDF[e], w_down_EFD[e]
        torch.mm(grad_rows_AD[rows], wd.T, out=dh_AF[rows])
        torch.mul(dh_AF[rows], silu_AF[rows], out=du_AF[rows])
        torch.ops.aten.silu_backward.grad_input(dh_AF[rows] * up_AF[rows], gate_AF[rows], grad_input=dg_AF[rows])
        torch.mm(h_AF[rows].T, grad_rows_AD[rows], out=grad_down[e])  # an expert with no rows: zeros
        torch.mm(x_AD[rows].T, dg_AF[rows], out=grad_gate[e])
        torch.mm(x_AD[rows].T, du_AF[rows], out=grad_up[e])
        torch.mm(dg_AF[rows], wg.T, out=dx_AD[rows])
        dx_AD[rows] += du_AF[rows] @ wu.T
    num_slots = int(slot_A.max()) + 1 if slot_A.numel() else 1
    grad_x_ND = scatter_sum(dx_AD, token_sorted_A, slot_A, num_slots, x_ND.shape[0])
    return grad_x_ND, grad_weight_A, grad_gate, grad_up, grad_down


@_moe_ffn_backward_op.register_fake
def input_gradients_fake(grad_ND, x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD, *saved):
    """The fake (meta) kernel of a backward operator of the MoE FFN signature: the gradients of
    (x, weight, w_gate, w_up, w_down), contiguous as the real operators return them, whatever the
    strides of the inputs (the experts of a transformers model are transposed views of its fused
    tensors)."""
    return tuple(t.new_empty(t.shape) for t in (x_ND, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD))


def save_inputs_and_extras(ctx, inputs, output):
    """``setup_context`` of an MoE FFN operator whose output 0 is y and whose other outputs are
    what its backward needs: all saved, the extras non-differentiable."""
    ctx.save_for_backward(*inputs, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients for the saved outputs


def backward_through(backward_op):
    """The autograd backward of an operator set up by :func:`save_inputs_and_extras`:
    ``backward_op(grad_ND, *saved)`` returns the gradients of (x, weight, w_gate, w_up, w_down)."""

    def backward(ctx, grad_ND, *_grads_of_saved):
        dx, dweight, dgate, dup, ddown = backward_op(grad_ND.contiguous(), *ctx.saved_tensors)
        return dx, None, None, dweight, dgate, dup, ddown

    return backward


_moe_ffn_op.register_autograd(
    backward_through(torch.ops.causal_moe_kernels.sorted_moe_ffn_backward), setup_context=save_inputs_and_extras
)
