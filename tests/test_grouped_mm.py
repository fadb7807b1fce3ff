"""The grouped-GEMM backend (``backend="grouped_mm"``, ``causal_moe_kernels.torch_grouped``) against the float64
reference, output and every gradient, for both expert layouts, eager, compiled and expert-parallel.

``torch._grouped_mm`` has no float64, so the backend runs in float32 (and bfloat16) and is compared
with ``moe_ffn_reference`` in float64 on the same values. Tolerance for float32: 2e-5 of the
largest reference value; each output element is a sum of at most D + F + a few products of
unit-scale factors, each rounded to 2**-24 relative, so the error stays near 1e-6 relative
(measured: 5e-7). bfloat16: twice the torch path's own bfloat16 error plus one bfloat16 ulp of
the largest value (the two round the same inputs; this one sums tokens in fp32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile import HOST_READS, recording_backend
from test_compile import run as run_layer
from test_fused_experts import fused_from, per_token_reference

import causal_moe_kernels.torch_grouped as torch_grouped
from causal_moe_kernels.reference import moe_ffn_reference
from causal_moe_kernels.torch_grouped import aligned, moe_ffn_grouped_mm
from moe import MoELayer
from moe.experts import CUDA_AUTO, FusedSwiGLUExperts, SwiGLUExperts, resolve_backend
from moe.parallel import ExpertParallel, load_full_state_dict
from moe.parallel.launch import ok_values, run_local

EPS = {torch.float32: 2e-5, torch.bfloat16: 2**-7}

# N=10 tokens, 11 assignments: expert 3 gets no row, tokens 2, 4 and 6 no expert, token 3 three.
TOKEN_A = torch.tensor([0, 0, 1, 3, 3, 3, 5, 7, 8, 8, 9])
EXPERT_A = torch.tensor([1, 2, 1, 0, 1, 2, 1, 2, 1, 2, 1])
N, E = 10, 4


def assert_near(name: str, got: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor | None = None) -> None:
    """|got - ref64| <= eps(dtype) * max|ref64| (+ 2x the same-dtype torch path's error in bf16)."""
    diff = (got.double() - ref64).abs()
    tol = EPS[got.dtype] * ref64.abs().max().clamp_min(1e-6).item()
    if same_dtype is not None:
        tol += 2 * (same_dtype.double() - ref64).abs().max().item()
    assert diff.max() <= tol, f"{name}: max diff {diff.max():.3e} mean {diff.mean():.3e} > tol {tol:.3e}"


def ffn_run(fn, dtype, x, weight, ws, loss="weighted"):
    """[y, dx, dweight, dw_gate, dw_up, dw_down] of ``fn`` on copies of the inputs in ``dtype``."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, *ws)]
    w = weight.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
    y = fn(leaves[0], TOKEN_A, EXPERT_A, w, *leaves[1:])
    if loss == "sum":  # a stride-0 output gradient, which torch._grouped_mm's own backward rejects
        y.sum().backward()
    else:
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), leaves[0].grad, w.grad, *(t.grad for t in leaves[1:])]


def inputs(d: int, f: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=gen, dtype=torch.float64)
    weight = torch.rand(TOKEN_A.numel(), generator=gen, dtype=torch.float64) + 0.1
    ws = (
        torch.randn(E, d, f, generator=gen, dtype=torch.float64) / d**0.5,
        torch.randn(E, d, f, generator=gen, dtype=torch.float64) / d**0.5,
        torch.randn(E, f, d, generator=gen, dtype=torch.float64) / f**0.5,
    )
    return x, weight, ws


@pytest.mark.parametrize("d,f", [(8, 12), (6, 5)], ids=["aligned", "padded"])
@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_equals_float64_reference_with_empty_experts_and_tokens(d, f, loss):
    """Widths of a multiple of 16 bytes run in place; 6 and 5 fp32 columns go through padded copies."""
    x, weight, ws = inputs(d, f)
    got = ffn_run(moe_ffn_grouped_mm, torch.float32, x, weight, ws, loss)
    ref = ffn_run(moe_ffn_reference, torch.float64, x, weight, ws, loss)
    names = ["y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"]
    for name, g, r in zip(names, got, ref, strict=True):
        assert g.dtype == torch.float32, f"{name}: {g.dtype}"
        assert_near(name, g, r)
    assert got[0][[2, 4, 6]].abs().max() == 0 and got[1][[2, 4, 6]].abs().max() == 0, "tokens without experts"
    assert got[3][3].abs().max() == 0 and got[5][3].abs().max() == 0, "expert 3 had no row: zero gradients"
    assert got[3][1].abs().max() > 0


def test_bfloat16_within_twice_the_torch_paths_error():
    x, weight, ws = inputs(16, 24, seed=1)
    got = ffn_run(moe_ffn_grouped_mm, torch.bfloat16, x, weight, ws)
    same = ffn_run(moe_ffn_reference, torch.bfloat16, x, weight, ws)
    ref = ffn_run(moe_ffn_reference, torch.float64, x, weight, ws)
    for name, g, s, r in zip(["y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"], got, same, ref, strict=True):
        assert g.dtype == s.dtype, f"{name}: {g.dtype} != {s.dtype}"
        assert_near(name, g, r, s)


def test_every_expert_matmul_is_a_grouped_gemm(monkeypatch):
    """Three grouped GEMMs forward, five backward; no other matmul on the expert weights."""
    calls = []
    real = torch._grouped_mm

    def counting(a, b, offs=None):
        calls.append((a.dim(), b.dim(), offs.dtype))
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    x, weight, ws = inputs(8, 12)
    ffn_run(moe_ffn_grouped_mm, torch.float32, x, weight, ws)
    assert [c[:2] for c in calls] == [(2, 3)] * 4 + [(2, 2)] * 3 + [(2, 3)] * 2, calls
    assert {c[2] for c in calls} == {torch.int32}


def test_fused_layout_matches_the_per_token_loop():
    """transformers' layout (FusedSwiGLUExperts: transposed views of gate_up_proj [E, 2F, D] and
    down_proj [E, D, F]) through the grouped GEMMs, against a per-token loop in float64."""
    torch.manual_seed(3)
    fused64 = fused_from(SwiGLUExperts(E, 8, 12).double())
    fused = FusedSwiGLUExperts(
        *(torch.nn.Parameter(p.detach().float().contiguous()) for p in (fused64.gate_up_proj, fused64.down_proj))
    )
    assert not fused.w_gate.is_contiguous() and not fused.w_down.is_contiguous()
    x64, weight64 = torch.randn(N, 8, dtype=torch.float64), torch.rand(TOKEN_A.numel(), dtype=torch.float64)
    x, weight = x64.float().requires_grad_(), weight64.float().requires_grad_()
    gy = torch.randn(N, 8, dtype=torch.float64)
    (fused(x, TOKEN_A, EXPERT_A, weight, "grouped_mm") * gy.float()).sum().backward()
    leaves64 = [t.detach().clone().requires_grad_() for t in (x64, weight64, fused64.gate_up_proj, fused64.down_proj)]
    (per_token_reference(leaves64[0], TOKEN_A, EXPERT_A, *leaves64[1:]) * gy).sum().backward()
    got = [x.grad, weight.grad, fused.gate_up_proj.grad, fused.down_proj.grad]
    for name, g, r in zip(["dx", "dweight", "dgate_up", "ddown"], got, [t.grad for t in leaves64], strict=True):
        assert_near(name, g, r)


def test_bad_dtypes_give_one_clear_error():
    x, weight, ws = inputs(8, 12)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        moe_ffn_grouped_mm(x, TOKEN_A, EXPERT_A, weight, *ws)
    with pytest.raises(ValueError, match="share one dtype"):
        moe_ffn_grouped_mm(x.float(), TOKEN_A, EXPERT_A, weight.float(), *(w.bfloat16() for w in ws))


def test_autocast_casts_to_its_dtype_and_fp32_weights_get_gradients():
    x, weight, ws = inputs(16, 24, seed=2)
    leaves = [t.float().requires_grad_() for t in (x, *ws)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe_ffn_grouped_mm(leaves[0], TOKEN_A, EXPERT_A, weight.float(), *leaves[1:])
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in leaves)
    assert_near("y under autocast", y, moe_ffn_reference(x, TOKEN_A, EXPERT_A, weight, *ws), None)


def test_aligned_keeps_qualifying_tensors_and_pads_the_others():
    ok = torch.randn(3, 8, 12)
    assert aligned(ok) is ok and aligned(ok.transpose(1, 2)).data_ptr() == ok.data_ptr()
    for bad in (torch.randn(3, 8, 5), torch.randn(1, 4).expand(6, 4), torch.randn(6, 9)[:, 1:5]):
        fixed = aligned(bad)
        assert torch.equal(fixed, bad) and fixed.stride(-1) == 1 and fixed.stride(-2) % 4 == 0, fixed.stride()
        assert fixed.data_ptr() % 16 == 0


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # also fills torch.empty with NaN: unwritten rows show
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("d,f", [(16, 24), (6, 5)], ids=["aligned", "padded"])
def test_layer_bitwise_reproducible_and_reads_no_unwritten_memory(d, f, deterministic):
    layer = MoELayer(d, f, E, router="expert_choice", capacity_factor=1.0, backend="grouped_mm")
    x = torch.randn(3, 8, d)
    first, second = run_layer(layer, x), run_layer(layer, x)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert not a.isnan().any(), f"tensor {i} has NaN: an unwritten (uninitialised) row was read"
        assert torch.equal(a, b), f"tensor {i} differs between reruns: max {(a - b).abs().max():.3e}"


def test_auto_is_grouped_mm_on_cuda_and_torch_on_cpu():
    assert CUDA_AUTO == "grouped_mm"
    assert resolve_backend("auto", torch.device("cuda")) is moe_ffn_grouped_mm
    assert resolve_backend("auto", torch.device("cpu")) is moe_ffn_reference
    assert resolve_backend("grouped_mm") is torch_grouped.moe_ffn_grouped_mm


# -- torch.compile ------------------------------------------------------------------------

COMPILED = [
    ("topk", {"top_k": 2}),
    ("capacity", {"top_k": 2, "capacity_factor": 0.75, "capacity_scope": "prefix"}),
]


@pytest.mark.parametrize("name,opts", COMPILED)
def test_compiled_layer_is_one_graph_calling_the_operator_and_equals_eager(name, opts):
    torch._dynamo.reset()
    layer = MoELayer(16, 32, E, router=name, backend="grouped_mm", **opts)
    x = torch.randn(2, 9, 16)
    graphs: list = []
    got = run_layer(layer, x, torch.compile(layer, backend=recording_backend(graphs), fullgraph=True))
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if any(h in t for h in HOST_READS)], targets
    assert targets.count("causal_moe_kernels.grouped_mm_moe_ffn.default") == 1, targets
    assert targets.count("causal_moe_kernels.grouped_mm_moe_ffn_backward.default") == 1, targets
    ref = copy.deepcopy(layer)
    ref.backend = "torch"
    for i, (g, r) in enumerate(zip(got, run_layer(ref, x), strict=True)):
        assert_near(f"{name} compiled grouped_mm vs eager torch, tensor {i}", g, r.double())


@pytest.mark.slow
def test_compiled_by_inductor_equals_eager():
    torch._dynamo.reset()
    layer = MoELayer(16, 32, E, router="topk", top_k=2, backend="grouped_mm")
    x = torch.randn(2, 9, 16)
    got, want = run_layer(layer, x, torch.compile(layer, fullgraph=True)), run_layer(layer, x)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_near(f"inductor tensor {i}", g, w.double())


def test_fake_kernels_match_real_strides_on_transposed_experts():
    """The compiler plans with the fake kernels: same shapes and strides as the real operators,
    also for a transformers model's experts (transposed views), and the op checks of torch.library."""
    fused = fused_from(SwiGLUExperts(E, 8, 12))
    ws = (fused.w_gate, fused.w_up, fused.w_down)
    forward = (torch.randn(N, 8), TOKEN_A, EXPERT_A, torch.rand(TOKEN_A.numel()), *ws)
    op, backward_op = (
        torch.ops.causal_moe_kernels.grouped_mm_moe_ffn,
        torch.ops.causal_moe_kernels.grouped_mm_moe_ffn_backward,
    )
    torch.library.opcheck(op.default, forward, test_utils=("test_schema", "test_faketensor"))
    backward = (torch.randn(N, 8), *forward, *op(*forward)[1:])
    torch.library.opcheck(backward_op.default, backward, test_utils=("test_schema", "test_faketensor"))
    for fn, args in ((op, forward), (backward_op, backward)):
        real = fn(*args)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = fn(*(mode.from_tensor(t) for t in args))
        for i, (r, k) in enumerate(zip(real, fake, strict=True)):
            assert (r.shape, r.stride(), r.dtype) == (k.shape, k.stride(), k.dtype), f"{fn} output {i}"


# -- expert parallelism -------------------------------------------------------------------

EP_CASES = {
    "topk": ({"top_k": 2}, False),
    "expert_choice": ({"capacity_factor": 1.0}, False),  # tokens with no expert, several
    "topk_skewed": ({"top_k": 2}, True),  # every token prefers experts 0 and 1: rank 1 receives no row
}


def _ep_worker(rank: int, world: int) -> dict[str, float]:
    """Max relative differences, EP on ``world`` ranks (grouped_mm) vs one process (grouped_mm),
    in float32, for this rank's tokens and experts; and the rows this rank received."""
    out: dict[str, float] = {}
    rows = slice(2 * rank, 2 * rank + 2)
    for case, (opts, skewed) in EP_CASES.items():
        torch.manual_seed(1)
        full = MoELayer(8, 12, E, router=case.removesuffix("_skewed"), backend="grouped_mm", **opts)
        if skewed:
            with torch.no_grad():
                full.router.gate.weight[:, 0] = torch.tensor([1.0, 0.8, -1.0, -1.0])
        ep = MoELayer(
            8, 12, E, router=case.removesuffix("_skewed"), backend="grouped_mm", expert_parallel=ExpertParallel(None)
        )
        load_full_state_dict(ep, full.state_dict())
        torch.manual_seed(2)
        x, g = torch.randn(2 * world, 6, 8), torch.randn(2 * world, 6, 8)
        if skewed:
            x[..., 0] = 10.0
        x_full, x_r = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        y_full, routing = full(x_full, return_routing=True)
        (y_full * g).sum().backward()
        y_r = ep(x_r)
        (y_r * g[rows]).sum().backward()
        start, stop = ep.local_experts
        pairs = {"y": (y_r, y_full[rows]), "dx": (x_r.grad, x_full.grad[rows])}
        for w in ("w_gate", "w_up", "w_down"):
            pairs[w] = (getattr(ep.experts, w).grad, getattr(full.experts, w).grad[start:stop])
        for key, (a, b) in pairs.items():
            out[f"{case}/{key}"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        out[f"{case}/rows_received"] = float(((routing.expert >= start) & (routing.expert < stop)).sum())
    return out


def test_expert_parallel_on_two_processes_equals_one_process():
    per_rank = ok_values(run_local(_ep_worker, 2))
    for rank, res in enumerate(per_rank):
        for key, v in res.items():
            if not key.endswith("rows_received"):
                assert v <= EPS[torch.float32], f"rank {rank} {key}: relative max |EP - single| = {v:.3e}"
    received = [res["topk_skewed/rows_received"] for res in per_rank]
    assert received[0] > 0 and received[1] == 0, f"the skewed case must leave rank 1 without rows: {received}"


# -- GPU (skipped without CUDA) -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_equals_reference_and_reruns_bitwise(dtype):
    torch.manual_seed(7)
    layer = MoELayer(256, 384, 8, router="expert_choice", capacity_factor=1.0, backend="grouped_mm").cuda()
    x = torch.randn(4, 250, 256, device="cuda")
    ref = copy.deepcopy(layer).double()
    ref.backend = "torch"
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        first, second = run_layer(layer, x), run_layer(layer, x)
    want = run_layer(ref, x.double())
    for i, (a, b, r) in enumerate(zip(first, second, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs between reruns on CUDA"
        tol = (2**-6 if dtype == torch.bfloat16 else 1e-4) * r.abs().max().item()
        assert (a.double() - r).abs().max() <= tol, f"tensor {i}: max {(a.double() - r).abs().max():.3e}"


@pytest.mark.gpu
def test_cuda_empty_experts_get_zero_weight_gradients():
    """torch issue 172439: sm_100 gave empty groups non-zero gradients; sm_90 (H100/H200) must not."""
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    token_A, expert_A = torch.arange(64, device="cuda"), torch.tensor([1, 3] * 32, device="cuda")
    ws = [torch.randn(4, *s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in ((64, 96),) * 2]
    ws.append(torch.randn(4, 96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    for _ in range(3):  # recycled allocator blocks: garbage would show on a later call
        for w in ws:
            w.grad = None
        moe_ffn_grouped_mm(x, token_A, expert_A, torch.ones(64, device="cuda"), *ws).float().square().sum().backward()
        for w in ws:
            assert w.grad[[0, 2]].abs().max() == 0 and w.grad[[1, 3]].abs().max() > 0


@pytest.mark.gpu
def test_layer_auto_backend_is_grouped_mm_on_cuda():
    layer = MoELayer(64, 128, 4, router="topk", top_k=2, backend="auto").cuda()
    ref = copy.deepcopy(layer)
    ref.backend = "torch"
    x = torch.randn(2, 64, 64, device="cuda")
    assert resolve_backend("auto", x.device) is moe_ffn_grouped_mm
    diff = (layer(x) - ref(x)).abs().max()
    assert diff <= 1e-4, f"auto (grouped_mm) vs torch on CUDA: max {diff:.3e}"
