"""Grouped expert matmul over stacked weights, forward and backward, as Triton kernels.

Shape legend: E experts, P rows in expert-sorted order (expert e owns rows
offsets[e]:offsets[e+1]), K reduction width, M output width (D or F), N tokens.
Weights are stacked [E, K, M]; any strides, so ``w.transpose(1, 2)`` is free.

``_gmm_kernel``: y[rows of e] = x[rows of e] @ w[e], fp32 accumulation, with

* gather on load: row p reads x[gather[p]] (dispatch fused into the first matmul);
* scatter on store: row p is written to y[scatter[p]] (back to assignment order);
* a mode (constexpr): ``LINEAR`` (one weight); ``SWIGLU`` (two weights, writes gate, up and
  h = silu(gate) * up); ``SWIGLU_BWD`` (the matmul gives dh, the epilogue reads gate and up
  and writes dgate, dup and the recomputed h); ``DUAL`` (x @ w + x2 @ w2, the input gradient
  through both SwiGLU weights).

Row tiles never straddle experts. A program finds its expert from the per-expert counts
(a cumulative sum of tiles per expert), so the grid is an upper bound, cdiv(P, BM) + E row
tiles (times the column tiles), and nothing waits for the host. ``_wgrad_kernel``: dw[e] =
x[rows of e]^T @ dy[rows of e], one program per (expert, output tile) looping over the
expert's rows: no atomics.
On CPU (interpreter) tiles are cast to fp32 before ``tl.dot`` (bf16 dots are wrong there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from causal_moe_kernels.dispatch_combine import combine_kernel
from causal_moe_kernels.launch import Kernel, check_same_device, interpreting, matmul_blocks, next_pow2
from causal_moe_kernels.metadata import RoutingMeta

LINEAR, SWIGLU, SWIGLU_BWD, DUAL = 0, 1, 2, 3


def _gmm_kernel(
    x_ptr,
    x2_ptr,
    w_ptr,
    w2_ptr,
    gather_ptr,
    scatter_ptr,
    y_ptr,
    y2_ptr,
    y3_ptr,
    gate_ptr,
    up_ptr,
    counts_ptr,
    offsets_ptr,
    M,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_ym,
    stride_yn,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Column tiles vary fastest: the programs in flight share a row tile (read from HBM once)
    # and one expert's weights (reused from L2 across that expert's row tiles).
    num_n = tl.cdiv(M, BN)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    ecols = tl.arange(0, BLOCK_E)
    tiles = (tl.load(counts_ptr + ecols, mask=ecols < E, other=0) + BM - 1) // BM
    last_tile = tl.cumsum(tiles, axis=0)
    if pid_m >= tl.sum(tiles, axis=0):
        return
    e = tl.sum((last_tile <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(ecols == e, last_tile - tiles, 0), axis=0)
    start = tl.load(offsets_ptr + e) + (pid_m - first_tile) * BM
    end = tl.load(offsets_ptr + e + 1)
    rows = start + tl.arange(0, BM)
    rm = rows < end
    if GATHER:
        x_rows = tl.load(gather_ptr + rows, mask=rm, other=0).to(tl.int64)
    else:
        x_rows = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cm = cols < M
    kk = tl.arange(0, BK)
    w_e = e.to(tl.int64) * stride_we
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        km = k < K
        x_off = x_rows[:, None] * stride_xm + k[None, :] * stride_xk
        w_off = w_e + k[:, None] * stride_wk + cols[None, :] * stride_wn
        a = tl.load(x_ptr + x_off, mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + w_off, mask=km[:, None] & cm[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if MODE == 1 or MODE == 3:
            b2 = tl.load(w2_ptr + w_off, mask=km[:, None] & cm[None, :], other=0.0)
            if DOT_FP32:
                b2 = b2.to(tl.float32)
            if MODE == 1:
                acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
            else:
                a2 = tl.load(x2_ptr + x_off, mask=rm[:, None] & km[None, :], other=0.0)
                if DOT_FP32:
                    a2 = a2.to(tl.float32)
                acc = tl.dot(a2, b2, acc, input_precision=PRECISION)
    if SCATTER:
        y_rows = tl.load(scatter_ptr + rows, mask=rm, other=0).to(tl.int64)
    else:
        y_rows = rows.to(tl.int64)
    y_off = y_rows[:, None] * stride_ym + cols[None, :] * stride_yn
    om = rm[:, None] & cm[None, :]
    out_ty = y_ptr.dtype.element_ty
    if MODE == 1:
        gate = acc.to(out_ty)
        up = acc2.to(out_ty)
        g32 = gate.to(tl.float32)
        tl.store(y_ptr + y_off, gate, mask=om)
        tl.store(y2_ptr + y_off, up, mask=om)
        tl.store(y3_ptr + y_off, g32 * tl.sigmoid(g32) * up.to(tl.float32), mask=om)
    elif MODE == 2:
        g32 = tl.load(gate_ptr + y_off, mask=om, other=0.0).to(tl.float32)
        u32 = tl.load(up_ptr + y_off, mask=om, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g32)
        silu = g32 * sig
        tl.store(y_ptr + y_off, acc * u32 * (sig + silu * (1.0 - sig)), mask=om)
        tl.store(y2_ptr + y_off, acc * silu, mask=om)
        tl.store(y3_ptr + y_off, silu * u32, mask=om)
    else:
        tl.store(y_ptr + y_off, acc, mask=om)


def _wgrad_kernel(
    x_ptr,
    dy_ptr,
    dy2_ptr,
    gather_ptr,
    dy_gather_ptr,
    dw_ptr,
    dw2_ptr,
    counts_ptr,
    offsets_ptr,
    K,
    M,
    stride_xm,
    stride_xk,
    stride_dym,
    stride_dyn,
    stride_we,
    stride_wk,
    stride_wn,
    GATHER: tl.constexpr,
    DY_GATHER: tl.constexpr,
    TWO: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # Tiles of one expert are consecutive: the programs in flight read the same expert's rows,
    # which then come from L2 for every tile after the first.
    num_n = tl.cdiv(M, BN)
    tiles = tl.cdiv(K, BM) * num_n
    e = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    kr = (tile // num_n) * BM + tl.arange(0, BM)
    cols = (tile % num_n) * BN + tl.arange(0, BN)
    krm = kr < K
    cm = cols < M
    start = tl.load(offsets_ptr + e)
    count = tl.load(counts_ptr + e)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for r0 in range(0, count, BK):
        rr = r0 + tl.arange(0, BK)
        rm = rr < count
        rows = start + rr
        if GATHER:
            x_rows = tl.load(gather_ptr + rows, mask=rm, other=0).to(tl.int64)
        else:
            x_rows = rows.to(tl.int64)
        if DY_GATHER:
            dy_rows = tl.load(dy_gather_ptr + rows, mask=rm, other=0).to(tl.int64)
        else:
            dy_rows = rows.to(tl.int64)
        xt = tl.load(
            x_ptr + x_rows[None, :] * stride_xm + kr[:, None] * stride_xk, mask=krm[:, None] & rm[None, :], other=0.0
        )
        dy_off = dy_rows[:, None] * stride_dym + cols[None, :] * stride_dyn
        dy = tl.load(dy_ptr + dy_off, mask=rm[:, None] & cm[None, :], other=0.0)
        if DOT_FP32:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
        if TWO:
            dy2 = tl.load(dy2_ptr + dy_off, mask=rm[:, None] & cm[None, :], other=0.0)
            if DOT_FP32:
                dy2 = dy2.to(tl.float32)
            acc2 = tl.dot(xt, dy2, acc2, input_precision=PRECISION)
    w_off = e.to(tl.int64) * stride_we + kr[:, None] * stride_wk + cols[None, :] * stride_wn
    om = krm[:, None] & cm[None, :]
    tl.store(dw_ptr + w_off, acc, mask=om)
    if TWO:
        tl.store(dw2_ptr + w_off, acc2, mask=om)


_gmm = Kernel(_gmm_kernel)
_wgrad = Kernel(_wgrad_kernel)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products on the GPU (not TF32); 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gmm(
    x: Tensor,
    w_EKM: Tensor,
    meta: RoutingMeta,
    *,
    mode: int = LINEAR,
    gather: Tensor | None = None,
    scatter: Tensor | None = None,
    out_rows: int | None = None,
    x2: Tensor | None = None,
    w2_EKM: Tensor | None = None,
    gate_PM: Tensor | None = None,
    up_PM: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Launch the grouped matmul; returns (y,) or, for SWIGLU / SWIGLU_BWD, three [P, M] tensors.

    ``x`` is [P, K], or any [*, K] with ``gather`` (int [P] row indices). ``scatter`` (int [P],
    distinct) writes row p to row scatter[p] of an output with ``out_rows`` rows (default P).
    SWIGLU returns (gate, up, h); SWIGLU_BWD takes ``gate_PM`` / ``up_PM`` and returns
    (dgate, dup, h); DUAL adds ``x2 @ w2`` (``x2`` [P, K]).
    """
    dev = check_same_device(x, w_EKM, meta.counts_E)
    e, k, m = w_EKM.shape
    p = meta.num_assignments
    if x.shape[-1] != k or (gather is None and x.shape[0] != p):
        raise ValueError(f"x {tuple(x.shape)} does not match weights {tuple(w_EKM.shape)} and {p} rows")
    if x.dtype != w_EKM.dtype:
        raise ValueError(f"x is {x.dtype} but the weights are {w_EKM.dtype}")
    x = x.contiguous()
    if x2 is not None:
        x2 = x2.contiguous()
    if w2_EKM is not None and w2_EKM.stride() != w_EKM.stride():
        w2_EKM = w2_EKM.contiguous()
        w_EKM = w_EKM.contiguous()
    rows_out = p if out_rows is None else out_rows
    outs = [
        torch.empty(rows_out, m, dtype=x.dtype, device=dev) for _ in range(3 if mode in (SWIGLU, SWIGLU_BWD) else 1)
    ]
    if scatter is not None and rows_out != p:
        outs[0].zero_()
    if p == 0 or m == 0:
        return tuple(o.zero_() for o in outs)
    blk = matmul_blocks(dev, x.dtype, m, k, p / e, two_acc=mode == SWIGLU, two_operands=mode == DUAL)
    grid = ((triton.cdiv(p, blk.bm) + e) * triton.cdiv(m, blk.bn),)
    y = outs[0]
    if mode == SWIGLU_BWD:
        gate_PM, up_PM = gate_PM.contiguous(), up_PM.contiguous()
    extra = {} if interpreting(dev) else {"num_warps": blk.num_warps, "num_stages": blk.num_stages}
    _gmm[grid, dev](
        x,
        x2 if x2 is not None else x,
        w_EKM,
        w2_EKM if w2_EKM is not None else w_EKM,
        gather if gather is not None else meta.counts_E,
        scatter if scatter is not None else meta.counts_E,
        y,
        outs[1] if len(outs) > 1 else y,
        outs[2] if len(outs) > 2 else y,
        gate_PM if gate_PM is not None else y,
        up_PM if up_PM is not None else y,
        meta.counts_E,
        meta.offsets_E,
        m,
        k,
        e,
        x.stride(0),
        x.stride(1),
        w_EKM.stride(0),
        w_EKM.stride(1),
        w_EKM.stride(2),
        y.stride(0),
        y.stride(1),
        GATHER=gather is not None,
        SCATTER=scatter is not None,
        MODE=mode,
        DOT_FP32=interpreting(dev),
        PRECISION=_precision(x.dtype),
        BM=blk.bm,
        BN=blk.bn,
        BK=blk.bk,
        BLOCK_E=max(2, next_pow2(e)),
        **extra,
    )
    return tuple(outs)


def wgrad(
    x: Tensor,
    dy_PM: Tensor,
    meta: RoutingMeta,
    *,
    gather: Tensor | None = None,
    dy_gather: Tensor | None = None,
    dy2_PM: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """dw[e] = x[rows of e]^T @ dy[rows of e] -> [E, K, M] (and the same with ``dy2``).

    ``gather`` / ``dy_gather`` index the rows of x / dy as in :func:`gmm`. Experts without
    rows get zeros. fp32 accumulation, stored in ``out_dtype`` (default x's dtype).
    """
    dev = check_same_device(x, dy_PM, meta.counts_E)
    e, k, m = meta.num_experts, x.shape[1], dy_PM.shape[1]
    x, dy_PM = x.contiguous(), dy_PM.contiguous()
    if dy2_PM is not None:
        dy2_PM = dy2_PM.contiguous()
    outs = [torch.empty(e, k, m, dtype=out_dtype or x.dtype, device=dev) for _ in range(1 if dy2_PM is None else 2)]
    if k == 0 or m == 0:
        return tuple(outs)
    blk = matmul_blocks(dev, x.dtype, m, k, two_acc=dy2_PM is not None)
    dw = outs[0]
    extra = {} if interpreting(dev) else {"num_warps": blk.num_warps, "num_stages": blk.num_stages}
    _wgrad[(e * triton.cdiv(k, blk.bm) * triton.cdiv(m, blk.bn),), dev](
        x,
        dy_PM,
        dy2_PM if dy2_PM is not None else dy_PM,
        gather if gather is not None else meta.counts_E,
        dy_gather if dy_gather is not None else meta.counts_E,
        dw,
        outs[-1],
        meta.counts_E,
        meta.offsets_E,
        k,
        m,
        x.stride(0),
        x.stride(1),
        dy_PM.stride(0),
        dy_PM.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        GATHER=gather is not None,
        DY_GATHER=dy_gather is not None,
        TWO=dy2_PM is not None,
        DOT_FP32=interpreting(dev),
        PRECISION=_precision(x.dtype),
        BM=blk.bm,
        BN=blk.bn,
        BK=blk.bk,
        **extra,
    )
    return tuple(outs)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, w_EKM: Tensor, meta: RoutingMeta, gather_tokens: bool, scatter_assignments: bool
    ) -> Tensor:
        ctx.save_for_backward(x, w_EKM)
        ctx.meta, ctx.gather_tokens, ctx.scatter_assignments = meta, gather_tokens, scatter_assignments
        return gmm(
            x,
            w_EKM,
            meta,
            gather=meta.token_P if gather_tokens else None,
            scatter=meta.perm_P if scatter_assignments else None,
        )[0]

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_EKM = ctx.saved_tensors
        meta = ctx.meta
        dy = dy.contiguous()
        dy_gather = meta.perm_P if ctx.scatter_assignments else None
        x_gather = meta.token_P if ctx.gather_tokens else None
        dx = dw = None
        if ctx.needs_input_grad[0]:
            (dx,) = gmm(dy, w_EKM.transpose(1, 2), meta, gather=dy_gather)
            if ctx.gather_tokens:
                dx = combine_kernel(dx, None, meta.pos_NE, x.dtype)
        if ctx.needs_input_grad[1]:
            (dw,) = wgrad(x, dy, meta, gather=x_gather, dy_gather=dy_gather, out_dtype=w_EKM.dtype)
        return dx, dw, None, None, None


def grouped_mm(
    x: Tensor, w_EKM: Tensor, meta: RoutingMeta, gather_tokens: bool = False, scatter_assignments: bool = False
) -> Tensor:
    """Expert-sorted rows times their expert's matrix: y[p] = x[p] @ w[expert of p], with autograd.

    ``gather_tokens``: x is [N, K] token rows, read through ``meta.token_P`` (fused dispatch;
    the input gradient sums each token's rows in a fixed order). ``scatter_assignments``: the
    output is in the caller's assignment order instead of expert order (row p stored at
    ``meta.perm_P[p]``). fp32 accumulation; weight gradients without atomics.
    """
    if w_EKM.dim() != 3 or w_EKM.shape[0] != meta.num_experts:
        raise ValueError(f"w_EKM must be [E={meta.num_experts}, K, M], got {tuple(w_EKM.shape)}")
    return _GroupedMM.apply(x, w_EKM, meta, gather_tokens, scatter_assignments)


def grouped_mm_reference(x_PK: Tensor, w_EKM: Tensor, counts_E: list[int]) -> Tensor:
    """Rows already in expert order: expert e's contiguous slice times w[e]."""
    outs = [x_e @ w_EKM[e] for e, x_e in enumerate(x_PK.split(counts_E))]
    return torch.cat(outs) if outs else x_PK.new_zeros(0, w_EKM.shape[-1])
