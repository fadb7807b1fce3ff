"""Every Triton kernel launch compiles for an H100/H200 (sm_90), on a machine without a GPU.

The default tests run the kernels in the interpreter, which never sees the compiler. Here
the launchers run on CPU tensors while believing they are on CUDA (``interpreting`` patched
to False), so they pick the GPU tile sizes, warps and stages, and each kernel launch is
recorded instead of run (the routing-metadata kernels also run, interpreted, because the
launchers index with their output). Triton's own launch binder turns each recorded launch
into the signature, constants and specialisations a real launch would compile (types from
the actual arguments, 16-divisibility, unit strides folded to constants): nothing is typed
by hand, so a launcher and a kernel that disagree fail here. ``triton.compile`` then builds
each for sm_90 with triton's bundled ptxas.

Asserted on what compiling produces: TTGIR, PTX and a cubin; the PTX entry is the kernel's
name; no ``atom.`` / ``red.`` instruction (the kernels are atomic-free); 16-bit matmuls use
Hopper's wgmma with cp.async pipelining; fp32 matmuls use no tensor-core instruction (exact
fp32 products, not TF32); shared memory fits an sm_90 block (227 KiB).

Default (seconds): the binder check and the non-matmul kernels of a bf16 forward + backward.
Slow (about 3 minutes on 2 cores with a cold triton cache): every launch of ``moe_ffn_triton``
and of the standalone ``dispatch`` / ``combine`` / ``grouped_mm`` (gather and scatter fused),
forward and backward, in fp32, fp16 and bf16, for training-sized and decode-sized expert loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from extras import need

triton = need("triton", "triton")

from test_determinism import triton_kernels  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import causal_moe_kernels.dispatch_combine as dispatch_combine_mod  # noqa: E402
import causal_moe_kernels.grouped_mm as grouped_mm_mod  # noqa: E402
import causal_moe_kernels.launch as launch_mod  # noqa: E402
from causal_moe_kernels.dispatch_combine import combine, dispatch  # noqa: E402
from causal_moe_kernels.grouped_mm import DUAL, LINEAR, SWIGLU, SWIGLU_BWD, grouped_mm  # noqa: E402
from causal_moe_kernels.metadata import routing_metadata  # noqa: E402
from causal_moe_kernels.moe_ffn import moe_ffn_triton  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on an H100/H200
MATMUL_KERNELS = {"_gmm_kernel", "_wgrad_kernel"}
# (tokens, d_model, d_ff, experts, top_k): 128 rows per expert picks the 128-row tiles of
# training shapes; 8 rows per expert the 64-row tiles of decoding.
TRAIN, DECODE = (256, 256, 256, 4, 2), (16, 256, 256, 4, 2)


@dataclass
class Launch:
    """One recorded kernel launch: the plain kernel function, its arguments and options."""

    fn: object
    args: tuple
    kwargs: dict


def record_launches(monkeypatch, run) -> list[Launch]:
    """Run ``run()`` with CPU tensors as if on CUDA and return the kernel launches it made."""
    launches: list[Launch] = []

    def getitem(kernel, grid_and_device):
        grid, _ = grid_and_device

        def launch(*args, **kwargs):
            launches.append(Launch(kernel.fn, args, kwargs))
            if kernel.fn.__module__ == "causal_moe_kernels.metadata":  # launchers index with its output
                options = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
                with launch_mod._nested_jit_interpreted():
                    kernel.form(True)[grid](*args, **options)

        return launch

    with monkeypatch.context() as m:
        m.setattr(launch_mod.Kernel, "__getitem__", getitem)
        for module in (launch_mod, grouped_mm_mod, dispatch_combine_mod):
            m.setattr(module, "interpreting", lambda device: False)
        run()
    return launches


def moe_ffn_fwd_bwd(dtype: torch.dtype, shape: tuple) -> None:
    n, d, f, e, k = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    ws = [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in ((e, d, f), (e, d, f), (e, f, d))]
    expert_A = torch.rand(n, e, generator=gen).topk(k, dim=1).indices.reshape(-1)
    weight_A = torch.rand(n * k, generator=gen).requires_grad_()
    y = moe_ffn_triton(x, torch.arange(n).repeat_interleave(k), expert_A, weight_A, *ws)
    y.float().sum().backward()


def standalone_ops(dtype: torch.dtype, shape: tuple) -> None:
    """dispatch, combine and grouped_mm with fused gather and scatter, forward and backward."""
    n, d, f, e, k = shape
    gen = torch.Generator().manual_seed(0)
    token_A = torch.arange(n).repeat_interleave(k)
    meta = routing_metadata(token_A, torch.rand(n, e, generator=gen).topk(k, dim=1).indices.reshape(-1), n, e)
    x = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(e, d, f, generator=gen).to(dtype).requires_grad_()
    rows = dispatch(x, meta)
    y = combine(rows, torch.rand(n * k, generator=gen).requires_grad_(), meta)
    h = grouped_mm(x, w, meta, gather_tokens=True, scatter_assignments=True)
    (y.float().sum() + h.float().sum()).backward()


def compile_sm90(launch: Launch):
    """Compile a recorded launch exactly as ``JITFunction.run`` would on an sm_90 device."""
    jf = JITFunction(launch.fn)
    backend = make_backend(SM90)
    binder = create_function_from_signature(jf.signature, jf.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = jf._pack_args(backend, launch.kwargs, bound, specialization, options)
    return triton.compile(ASTSource(jf, signature, constexprs, attrs), target=SM90, options=options.__dict__), signature


def distinct(launches: list[Launch]) -> dict[str, Launch]:
    """One launch per distinct compiled variant (kernel, argument types, constants, options)."""
    out = {}
    for launch in launches:
        consts = sorted((k, v) for k, v in launch.kwargs.items())
        types = tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in launch.args)
        out.setdefault(f"{launch.fn.__name__}{types}{consts}", launch)
    return out


def check_compiled(launch: Launch, dtype: torch.dtype) -> str:
    """Compile one launch and assert on its output; returns the kernel name."""
    name = launch.fn.__name__
    kernel, signature = compile_sm90(launch)
    ptx = kernel.asm["ptx"]
    assert kernel.asm["ttgir"] and kernel.asm["cubin"], name
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert entries == [name], f"{name}: PTX entries {entries}"
    atomics = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:atom|red)\.\S+)", ptx, re.MULTILINE)
    assert atomics == [], f"{name}: atomic instructions {atomics[:5]}"
    assert kernel.metadata.shared <= SM90_MAX_SHARED, f"{name}: {kernel.metadata.shared} bytes of shared memory"
    if name in MATMUL_KERNELS:
        operand = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
        assert signature["x_ptr"] == operand, f"{name}: x_ptr compiled as {signature['x_ptr']}, inputs are {dtype}"
        if dtype == torch.float32:
            assert not re.search(r"\b(wgmma|mma)\.", ptx), f"{name}: fp32 must not use tensor cores (TF32)"
        else:
            assert "wgmma.mma_async" in ptx and "cp.async" in ptx, f"{name}: 16-bit matmul without wgmma/cp.async"
    return name


def test_launch_binder_rejects_a_launcher_kernel_mismatch(monkeypatch):
    """The derived signature is the launcher's: an argument the kernel lacks is an error."""
    launches = record_launches(monkeypatch, lambda: moe_ffn_fwd_bwd(torch.bfloat16, DECODE))
    gmm = next(launch for launch in launches if launch.fn.__name__ == "_gmm_kernel")
    with pytest.raises(KeyError, match="unrecognised"):
        compile_sm90(Launch(gmm.fn, gmm.args, {**gmm.kwargs, "x_scale_ptr": gmm.args[0]}))
    with pytest.raises(TypeError):
        compile_sm90(Launch(gmm.fn, gmm.args[:-1], gmm.kwargs))


def test_data_movement_kernels_compile_for_sm90(monkeypatch):
    """The cheap part by default: every launch of the bf16 forward + backward but the matmuls."""
    launches = record_launches(monkeypatch, lambda: moe_ffn_fwd_bwd(torch.bfloat16, DECODE))
    cheap = [launch for launch in distinct(launches).values() if launch.fn.__name__ not in MATMUL_KERNELS]
    compiled = {check_compiled(launch, torch.bfloat16) for launch in cheap}
    assert compiled == set(triton_kernels()) - MATMUL_KERNELS


@pytest.mark.slow
@pytest.mark.parametrize("shape", [TRAIN, DECODE], ids=["train", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_launch_compiles_for_sm90(monkeypatch, dtype, shape):
    def run():
        moe_ffn_fwd_bwd(dtype, shape)
        standalone_ops(dtype, shape)

    launches = distinct(record_launches(monkeypatch, run))
    gmm_variants = {
        (v.kwargs["MODE"], v.kwargs["GATHER"], v.kwargs["SCATTER"])
        for v in launches.values()
        if v.fn.__name__ == "_gmm_kernel"
    }
    assert {
        (LINEAR, True, True),
        (SWIGLU, True, False),
        (SWIGLU_BWD, False, False),
        (DUAL, False, False),
    } <= gmm_variants
    compiled = [check_compiled(launch, dtype) for launch in launches.values()]
    assert set(compiled) == set(triton_kernels())
