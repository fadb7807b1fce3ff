"""Dispatch (gather token rows into expert-sorted order) and combine (weighted sum of each
token's rows), as Triton kernels with autograd, plus their PyTorch references.

Shape legend: N tokens, D model width, E experts, A assignments, P = A expert-sorted positions.

Both directions are deterministic and atomic-free:

* gather: row p of the output is row ``idx[p]`` of the input, optionally scaled by ``scale[p]``
  and optionally dotted with a second [P, D] tensor (the combine-weight gradient). One
  kernel serves dispatch, the backward of combine and the gradient of the weights.
* combine: token n sums its rows, read through ``pos_NE[n]`` in expert order, in fp32. One
  kernel serves combine and the backward of dispatch (weights = 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from causal_moe_kernels.launch import Kernel, check_same_device, interpreting, next_pow2
from causal_moe_kernels.metadata import RoutingMeta


def _gather_kernel(
    src_ptr,
    idx_ptr,
    out_ptr,
    scale_ptr,
    dot_ptr,
    dot_out_ptr,
    dot_dst_ptr,
    P,
    D,
    stride_src,
    stride_out,
    stride_dot,
    SCALE: tl.constexpr,
    DOT: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    rm = r < P
    src_row = tl.load(idx_ptr + r, mask=rm, other=0).to(tl.int64)
    r64 = r.to(tl.int64)
    if SCALE:
        s = tl.load(scale_ptr + r, mask=rm, other=0.0).to(tl.float32)
    dot = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = rm[:, None] & (d < D)[None, :]
        v = tl.load(src_ptr + src_row[:, None] * stride_src + d[None, :], mask=m, other=0.0)
        if DOT:
            other = tl.load(dot_ptr + r64[:, None] * stride_dot + d[None, :], mask=m, other=0.0)
            dot += tl.sum(v.to(tl.float32) * other.to(tl.float32), axis=1)
        if SCALE:
            v = v.to(tl.float32) * s[:, None]
        tl.store(out_ptr + r64[:, None] * stride_out + d[None, :], v, mask=m)
    if DOT:
        dst = tl.load(dot_dst_ptr + r, mask=rm, other=0)
        tl.store(dot_out_ptr + dst, dot, mask=rm)


def _combine_kernel(
    rows_ptr,
    w_ptr,
    pos_ptr,
    out_ptr,
    N,
    E,
    D,
    stride_rows,
    stride_out,
    WEIGHTED: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BD: tl.constexpr,
):
    n = tl.program_id(0) * BT + tl.arange(0, BT)
    nm = n < N
    n64 = n.to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    ecols = tl.arange(0, BLOCK_E)
    pos = tl.load(pos_ptr + n64[:, None] * E + ecols[None, :], mask=nm[:, None] & (ecols < E)[None, :], other=-1)
    valid = pos >= 0
    slot = tl.cumsum(valid.to(tl.int32), axis=1) - 1
    count = tl.sum(valid.to(tl.int32), axis=1)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in range(0, tl.max(count, axis=0)):
        p = tl.sum(tl.where(valid & (slot == j), pos, 0), axis=1).to(tl.int64)
        has = j < count
        row = tl.load(rows_ptr + p[:, None] * stride_rows + d[None, :], mask=has[:, None] & dm[None, :], other=0.0)
        row = row.to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(w_ptr + p, mask=has, other=0.0).to(tl.float32)[:, None]
        acc += row
    tl.store(out_ptr + n64[:, None] * stride_out + d[None, :], acc, mask=nm[:, None] & dm[None, :])


_gather = Kernel(_gather_kernel)
_combine = Kernel(_combine_kernel)


def _row_blocks(d: int, device: torch.device) -> tuple[int, int]:
    """(rows per program, columns per step): 4K-element tiles compiled, 16K interpreted
    (the interpreter's cost grows with the number of programs, not their size)."""
    bd = min(1024, max(16, next_pow2(d)))
    return max(1, (16384 if interpreting(device) else 4096) // bd), bd


def gather_rows_kernel(
    src_MD: Tensor,
    idx_P: Tensor,
    scale_P: Tensor | None = None,
    dot_with_PD: Tensor | None = None,
    dot_dst_P: Tensor | None = None,
    dot_size: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """out[p] = src[idx[p]] (* scale[p]); with ``dot_with``: dots[dot_dst[p]] = <src[idx[p]], dot_with[p]> in fp32.

    Returns (out_PD, dots or None); ``dots`` has ``dot_size`` entries.
    """
    dev = check_same_device(src_MD, idx_P)
    src_MD = src_MD.contiguous()
    p, d = idx_P.numel(), src_MD.shape[1]
    out = torch.empty(p, d, dtype=src_MD.dtype, device=dev)
    want_dot = dot_with_PD is not None
    dot_with_PD = dot_with_PD.contiguous() if want_dot else out
    dots = torch.zeros(dot_size, dtype=torch.float32, device=dev) if want_dot else None
    if p == 0:
        return out, dots
    br, bd = _row_blocks(d, dev)
    _gather[(triton.cdiv(p, br),), dev](
        src_MD,
        idx_P,
        out,
        scale_P if scale_P is not None else out,
        dot_with_PD,
        dots if want_dot else out,
        dot_dst_P if want_dot else idx_P,
        p,
        d,
        src_MD.stride(0),
        out.stride(0),
        dot_with_PD.stride(0),
        SCALE=scale_P is not None,
        DOT=want_dot,
        BR=br,
        BD=bd,
    )
    return out, dots


def combine_kernel(rows_PD: Tensor, weight_P: Tensor | None, pos_NE: Tensor, out_dtype: torch.dtype) -> Tensor:
    """y[n] = sum over token n's rows p (expert order) of weight[p] * rows[p], fp32 accumulation."""
    dev = check_same_device(rows_PD, pos_NE)
    rows_PD = rows_PD.contiguous()
    n, e = pos_NE.shape
    d = rows_PD.shape[1]
    out = torch.empty(n, d, dtype=out_dtype, device=dev)
    if n == 0 or d == 0:
        return out
    bt, bd = _row_blocks(d, dev)
    _combine[(triton.cdiv(n, bt), triton.cdiv(d, bd)), dev](
        rows_PD,
        weight_P if weight_P is not None else rows_PD,
        pos_NE,
        out,
        n,
        e,
        d,
        rows_PD.stride(0),
        out.stride(0),
        WEIGHTED=weight_P is not None,
        BT=bt,
        BLOCK_E=max(2, next_pow2(e)),
        BD=bd,
    )
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: Tensor, meta: RoutingMeta) -> Tensor:
        ctx.meta = meta
        return gather_rows_kernel(x_ND, meta.token_P)[0]

    @staticmethod
    def backward(ctx, grad_PD: Tensor):
        return combine_kernel(grad_PD, None, ctx.meta.pos_NE, grad_PD.dtype), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_PD: Tensor, weight_A: Tensor, meta: RoutingMeta) -> Tensor:
        weight_P = weight_A.float()[meta.perm_P]
        ctx.save_for_backward(rows_PD, weight_P)
        ctx.meta = meta
        return combine_kernel(rows_PD, weight_P, meta.pos_NE, rows_PD.dtype)

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        rows_PD, weight_P = ctx.saved_tensors
        meta = ctx.meta
        want_w = ctx.needs_input_grad[1]
        grad_rows, grad_w = gather_rows_kernel(
            grad_ND,
            meta.token_P,
            weight_P,
            dot_with_PD=rows_PD if want_w else None,
            dot_dst_P=meta.perm_P,
            dot_size=meta.num_assignments,
        )
        return grad_rows, grad_w, None


def dispatch(x_ND: Tensor, meta: RoutingMeta) -> Tensor:
    """[P, D]: x's token rows in expert-sorted order. Backward: each token sums its row gradients."""
    return _Dispatch.apply(x_ND, meta)


def combine(rows_PD: Tensor, weight_A: Tensor, meta: RoutingMeta) -> Tensor:
    """[N, D]: y[n] = sum of weight * row over n's assignments (weights in assignment order).

    Gradients flow to the rows and to the weights (<row, dy[token]> per assignment).
    """
    if weight_A.shape != (meta.num_assignments,):
        raise ValueError(f"weight_A must have shape [{meta.num_assignments}], got {tuple(weight_A.shape)}")
    return _Combine.apply(rows_PD, weight_A, meta)


def dispatch_reference(x_ND: Tensor, token_P: Tensor) -> Tensor:
    """x_ND[token_P] (autograd through torch indexing)."""
    return x_ND[token_P.long()]


def combine_reference(rows_PD: Tensor, weight_A: Tensor, perm_P: Tensor, token_P: Tensor, num_tokens: int) -> Tensor:
    """y = M @ rows with the dense [N, P] matrix M[token_P[p], p] = weight_A[perm_P[p]]."""
    p = rows_PD.shape[0]
    m_NP = rows_PD.new_zeros(num_tokens, p)
    m_NP = m_NP.index_put(
        (token_P.long(), torch.arange(p, device=rows_PD.device)), weight_A[perm_P.long()].to(rows_PD.dtype)
    )
    return m_NP @ rows_PD
