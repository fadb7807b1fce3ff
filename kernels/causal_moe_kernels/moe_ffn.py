"""The MoE feed-forward on Triton kernels: ``moe_ffn_triton``, a drop-in for
``causal_moe_kernels.reference.moe_ffn_reference`` (the ``"triton"`` backend of ``moe.MoELayer``).

Shape legend: N tokens, D model width, F expert width, E experts, A assignments,
P = A rows in expert-sorted order.

Forward (4 launches after the 3 of the routing metadata):

    gate, up, h = x[token_P] @ w_gate, x[token_P] @ w_up, silu(gate) * up     dispatch fused
    rows        = h @ w_down                                                  [P, D]
    y[n]        = sum of weight[p] * rows[p] over n's rows, fp32, expert order

Backward:

    drows, dweight = weight[p] * dy[token_P],  <rows[p], dy[token_P]>         one gather kernel
    dgate, dup, h  = epilogue of drows @ w_down^T (h recomputed, not stored)
    dw_down        = h^T drows per expert;  dw_gate, dw_up = x[token_P]^T [dgate | dup]
    dx             = combine(dgate @ w_gate^T + dup @ w_up^T)                  one DUAL matmul

Saved for backward: gate, up [P, F] and rows [P, D]. Everything is deterministic: no
atomics, fixed summation orders, so the same call twice is bitwise equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from causal_moe_kernels.dispatch_combine import combine_kernel, gather_rows_kernel
from causal_moe_kernels.ffn_inputs import check_ffn_shapes, one_dtype
from causal_moe_kernels.grouped_mm import DUAL, SWIGLU, SWIGLU_BWD, gmm, wgrad
from causal_moe_kernels.metadata import RoutingMeta, routing_metadata


class _MoEFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD, meta: RoutingMeta):
        gate_PF, up_PF, h_PF = gmm(x_ND, w_gate_EDF, meta, mode=SWIGLU, gather=meta.token_P, w2_EKM=w_up_EDF)
        (rows_PD,) = gmm(h_PF, w_down_EFD, meta)
        weight_P = weight_A.float()[meta.perm_P]
        ctx.save_for_backward(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, weight_P, gate_PF, up_PF, rows_PD)
        ctx.meta, ctx.weight_dtype = meta, weight_A.dtype
        return combine_kernel(rows_PD, weight_P, meta.pos_NE, x_ND.dtype)

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, w_gate, w_up, w_down, weight_P, gate_PF, up_PF, rows_PD = ctx.saved_tensors
        meta = ctx.meta
        need_x, need_w, need_gate, need_up, need_down, _ = ctx.needs_input_grad
        drows_PD, dweight_A = gather_rows_kernel(
            dy_ND.to(x_ND.dtype),
            meta.token_P,
            weight_P,
            dot_with_PD=rows_PD if need_w else None,
            dot_dst_P=meta.perm_P,
            dot_size=meta.num_assignments,
        )
        dgate_PF, dup_PF, h_PF = gmm(
            drows_PD, w_down.transpose(1, 2), meta, mode=SWIGLU_BWD, gate_PM=gate_PF, up_PM=up_PF
        )
        dx = dw_gate = dw_up = dw_down = None
        if need_down:
            (dw_down,) = wgrad(h_PF, drows_PD, meta, out_dtype=w_down.dtype)
        if need_gate or need_up:
            dw_gate, dw_up = wgrad(x_ND, dgate_PF, meta, gather=meta.token_P, dy2_PM=dup_PF, out_dtype=w_gate.dtype)
        if need_x:
            (dx_PD,) = gmm(dgate_PF, w_gate.transpose(1, 2), meta, mode=DUAL, x2=dup_PF, w2_EKM=w_up.transpose(1, 2))
            dx = combine_kernel(dx_PD, None, meta.pos_NE, x_ND.dtype)
        if dweight_A is not None:
            dweight_A = dweight_A.to(ctx.weight_dtype)
        return dx, dweight_A, dw_gate, dw_up, dw_down, None


def moe_ffn_triton(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> Tensor:
    """y[n] = sum over assignments a of token n: weight[a] * SwiGLU_{expert[a]}(x[n]).

    Same contract as ``moe_ffn_reference``; assignments must be distinct (token, expert)
    pairs. Inputs and expert weights share one dtype (fp32, fp16 or bf16), or autocast is on
    and both are cast to its dtype. CUDA tensors run compiled kernels, CPU tensors the
    Triton interpreter (slow: for tests). Tokens with no assignment get zeros.
    """
    check_ffn_shapes(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD)
    x_ND, w_gate_EDF, w_up_EDF, w_down_EFD = one_dtype(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD)
    n, e = x_ND.shape[0], w_gate_EDF.shape[0]
    if token_A.numel() == 0:
        return x_ND.new_zeros(n, w_down_EFD.shape[-1])
    meta = routing_metadata(token_A, expert_A, n, e)
    return _MoEFFN.apply(x_ND.contiguous(), weight_A, w_gate_EDF, w_up_EDF, w_down_EFD, meta)
