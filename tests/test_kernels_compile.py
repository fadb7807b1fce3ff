"""Every Triton kernel variant compiles for an H100/H200 (sm_90), on a machine without a GPU.

The default tests run the kernels in the interpreter, which never sees the compiler: this
compiles each (kernel, mode, dtype) the launchers use down to a cubin with triton's bundled
ptxas, specialised the way a real launch is (unit strides as constants, 16-divisible
pointers and sizes), and checks that the matmuls use Hopper's wgmma with cp.async
pipelining. Slow (about a minute), so marked ``slow``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels.dispatch_combine import _combine_kernel, _gather_kernel  # noqa: E402
from kernels.grouped_mm import DUAL, LINEAR, SWIGLU, SWIGLU_BWD, _gmm_kernel, _wgrad_kernel  # noqa: E402
from kernels.launch import matmul_blocks  # noqa: E402
from kernels.metadata import _histogram_kernel, _prefix_kernel, _scatter_kernel  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
CUDA = torch.device("cuda")
TY = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_sm90(fn, ptrs: dict, const: dict, ones=(), div16=(), num_warps=4, num_stages=3):
    jf = JITFunction(fn)
    sig = {p.name: "constexpr" if p.is_constexpr or p.name in ones else ptrs.get(p.name, "i32") for p in jf.params}
    const = {**const, **{n: 1 for n in ones}}
    attrs = {(jf.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(jf, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [LINEAR, SWIGLU, SWIGLU_BWD, DUAL])
def test_grouped_matmul_compiles_with_wgmma(mode, dtype):
    t = TY[dtype]
    ptrs = {n: t for n in ("x_ptr", "x2_ptr", "w_ptr", "w2_ptr", "y_ptr", "y2_ptr", "y3_ptr", "gate_ptr", "up_ptr")}
    ptrs.update({n: "*i32" for n in ("gather_ptr", "scatter_ptr", "counts_ptr", "offsets_ptr")})
    blk = matmul_blocks(CUDA, dtype, 2048, 2048, 1536, two_acc=mode == SWIGLU, two_operands=mode == DUAL)
    const = dict(
        GATHER=mode in (LINEAR, SWIGLU), SCATTER=mode == LINEAR, MODE=mode, DOT_FP32=False,
        PRECISION="ieee" if dtype == torch.float32 else "tf32", BM=blk.bm, BN=blk.bn, BK=blk.bk, BLOCK_E=64,
    )
    kernel = compile_sm90(
        _gmm_kernel, ptrs, const, ones=("stride_xk", "stride_wn", "stride_yn"),
        div16=[*ptrs, "M", "K", "stride_xm", "stride_we", "stride_wk", "stride_ym"],
        num_warps=blk.num_warps, num_stages=blk.num_stages,
    )
    ptx = kernel.asm["ptx"]
    if dtype != torch.float32:
        assert "wgmma" in ptx and "cp.async" in ptx, "16-bit grouped matmul must use wgmma with cp.async pipelining"


@pytest.mark.slow
@pytest.mark.parametrize("two", [False, True])
def test_weight_gradient_compiles_with_wgmma(two):
    ptrs = {n: "*bf16" for n in ("x_ptr", "dy_ptr", "dy2_ptr", "dw_ptr", "dw2_ptr")}
    ptrs.update({n: "*i32" for n in ("gather_ptr", "dy_gather_ptr", "counts_ptr", "offsets_ptr")})
    blk = matmul_blocks(CUDA, torch.bfloat16, 1408, 2048, two_acc=two)
    const = dict(GATHER=True, DY_GATHER=False, TWO=two, DOT_FP32=False, PRECISION="tf32", BM=blk.bm, BN=blk.bn, BK=blk.bk)
    kernel = compile_sm90(
        _wgrad_kernel, ptrs, const, ones=("stride_xk", "stride_dyn", "stride_wn"),
        div16=[*ptrs, "K", "M", "stride_xm", "stride_dym", "stride_we", "stride_wk"],
        num_warps=blk.num_warps, num_stages=blk.num_stages,
    )
    assert "wgmma" in kernel.asm["ptx"]


@pytest.mark.slow
def test_dispatch_combine_and_metadata_compile():
    compile_sm90(
        _gather_kernel,
        {"src_ptr": "*bf16", "idx_ptr": "*i32", "out_ptr": "*bf16", "scale_ptr": "*fp32", "dot_ptr": "*bf16",
         "dot_out_ptr": "*fp32", "dot_dst_ptr": "*i32"},
        dict(SCALE=True, DOT=True, BR=4, BD=1024),
    )
    compile_sm90(
        _combine_kernel, {"rows_ptr": "*bf16", "w_ptr": "*fp32", "pos_ptr": "*i32", "out_ptr": "*bf16"},
        dict(WEIGHTED=True, BT=4, BLOCK_E=64, BD=1024),
    )
    compile_sm90(_histogram_kernel, {"expert_ptr": "*i64", "hist_ptr": "*i32"}, dict(BLOCK=256, BLOCK_E=64))
    compile_sm90(
        _prefix_kernel, {n: "*i32" for n in ("hist_ptr", "base_ptr", "counts_ptr", "offsets_ptr")}, dict(CHUNK=64, BLOCK_E=64)
    )
    compile_sm90(
        _scatter_kernel,
        {"expert_ptr": "*i64", "token_ptr": "*i64", **{n: "*i32" for n in ("base_ptr", "offsets_ptr", "perm_ptr", "token_sorted_ptr", "pos_ptr")}},
        dict(BLOCK=256, BLOCK_E=64),
    )
