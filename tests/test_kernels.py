"""Triton kernels against their PyTorch references, forward and every gradient.

On a machine without CUDA every kernel runs in the Triton interpreter: ``causal_moe_kernels.launch``
chooses per launch (CPU tensors are interpreted, CUDA tensors compiled), so nothing here
depends on ``TRITON_INTERPRET`` or on import order. The interpreter is slow: shapes are
small, the larger sweep is ``@pytest.mark.slow``.

Tolerances: results are compared with a float64 reference. A 16-bit kernel may be at most
twice as far from it as the torch path in the same dtype (plus one ulp of the largest
value), since both round their inputs and intermediates the same way and the kernels
accumulate in fp32. fp32 kernels accumulate in fp32 over at most ~200 terms: 2e-5 relative.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from extras import need
from helpers import SOURCE_PATH

need("triton", "triton")

from causal_moe_kernels.dispatch_combine import combine, combine_reference, dispatch, dispatch_reference  # noqa: E402
from causal_moe_kernels.grouped_mm import grouped_mm, grouped_mm_reference  # noqa: E402
from causal_moe_kernels.metadata import routing_metadata, routing_metadata_reference  # noqa: E402
from causal_moe_kernels.moe_ffn import moe_ffn_triton  # noqa: E402
from causal_moe_kernels.reference import moe_ffn_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16]
EPS = {torch.float32: 2e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def assert_near(name: str, got, ref64, same_dtype=None, dtype=torch.float32):
    """|got - ref64| <= 2 * |same_dtype - ref64| + eps(dtype) * max|ref64| (see module doc)."""
    got, ref64 = got.double(), ref64.double()
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    diff = (got - ref64).abs()
    scale = max(ref64.abs().max().item(), 1e-6) if ref64.numel() else 1.0
    tol = EPS[dtype] * scale
    if same_dtype is not None and dtype != torch.float32:
        tol += 2 * (same_dtype.double() - ref64).abs().max().item()
    worst = diff.max().item() if diff.numel() else 0.0
    assert worst <= tol, f"{name}: max diff {worst:.3e} mean {diff.mean().item():.3e} > tol {tol:.3e} ({dtype})"


def assignments(kind: str, n: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_A, expert_A) of a routing pattern: distinct (token, expert) pairs."""
    if kind == "topk":  # token-major, k distinct experts per token
        expert_NK = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        return torch.arange(n).repeat_interleave(k), expert_NK.reshape(-1)
    if kind == "one_expert":  # every token on expert e-1, others empty
        return torch.arange(n), torch.full((n,), e - 1)
    if kind == "empty_experts":  # experts 0 and 2 get nothing
        used = torch.tensor([x for x in range(e) if x not in (0, 2)])
        expert_NK = torch.stack([used[torch.randperm(len(used), generator=gen)[:k]] for _ in range(n)])
        return torch.arange(n).repeat_interleave(k), expert_NK.reshape(-1)
    if kind == "expert_choice":  # expert-major, c tokens each: some tokens 0 rows, some several
        c = max(1, n * k // e)
        token_EC = torch.stack([torch.randperm(n, generator=gen)[:c] for _ in range(e)])
        return token_EC.reshape(-1), torch.arange(e).repeat_interleave(c)
    raise ValueError(kind)


def leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf copy of t in dtype (``t.to(t.dtype)`` would alias t itself)."""
    return t.detach().to(dtype).clone().requires_grad_()


def ffn_inputs(n, d, f, e, a, gen):
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.rand(a, generator=gen, dtype=torch.float64) + 0.1
    ws = (
        torch.randn(e, d, f, generator=gen, dtype=torch.float64) / d**0.5,
        torch.randn(e, d, f, generator=gen, dtype=torch.float64) / d**0.5,
        torch.randn(e, f, d, generator=gen, dtype=torch.float64) / f**0.5,
    )
    return x, w, ws


NAMES = ["y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"]


def run_ffn(fn, x, token_A, expert_A, w, ws, dtype, gy):
    """Forward + backward; returns [y, dx, dweight, dw_gate, dw_up, dw_down]."""
    leaves = [leaf(t, dtype) for t in (x, *ws)]
    weight = leaf(w, torch.float64 if dtype == torch.float64 else torch.float32)
    y = fn(leaves[0], token_A, expert_A, weight, *leaves[1:])
    y.backward(gy.to(y.dtype))
    return [y.detach(), leaves[0].grad, weight.grad, *(leaf.grad for leaf in leaves[1:])]


def check_moe_ffn(kind, n, d, f, e, k, dtype, seed, device="cpu", rerun=False):
    """moe_ffn_triton vs the float64 reference (and the same-dtype torch path): y and all grads."""
    gen = torch.Generator().manual_seed(seed)
    token_A, expert_A = assignments(kind, n, e, k, gen)
    x, w, ws = ffn_inputs(n, d, f, e, token_A.numel(), gen)
    gy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x, token_A, expert_A, w, gy, *ws = (t.to(device) for t in (x, token_A, expert_A, w, gy, *ws))
    got = run_ffn(moe_ffn_triton, x, token_A, expert_A, w, ws, dtype, gy)
    ref64 = run_ffn(moe_ffn_reference, x, token_A, expert_A, w, ws, torch.float64, gy)
    same = run_ffn(moe_ffn_reference, x, token_A, expert_A, w, ws, dtype, gy)
    again = run_ffn(moe_ffn_triton, x, token_A, expert_A, w, ws, dtype, gy) if rerun else got
    for name, g, g2, r, s in zip(NAMES, got, again, ref64, same):
        assert g.dtype == s.dtype, f"{name}: dtype {g.dtype} != reference {s.dtype}"
        assert torch.equal(g, g2), f"{name}: two identical calls differ"
        assert_near(f"{kind} {name} on {device}", g, r, s, dtype)


# -- routing metadata ------------------------------------------------------------------


def test_metadata_hand_worked():
    # assignments a: (token, expert) = (0,2) (0,0) (1,2) (2,1); E=4, expert 3 empty, token 3 none.
    token_A, expert_A = torch.tensor([0, 0, 1, 2]), torch.tensor([2, 0, 2, 1])
    m = routing_metadata(token_A, expert_A, num_tokens=4, num_experts=4)
    assert m.perm_P.tolist() == [1, 3, 0, 2]  # expert 0: a1; expert 1: a3; expert 2: a0, a2 (stable)
    assert m.token_P.tolist() == [0, 2, 0, 1]
    assert m.counts_E.tolist() == [1, 1, 2, 0]
    assert m.offsets_E.tolist() == [0, 1, 2, 4, 4]
    assert m.pos_NE.tolist() == [[0, -1, 2, -1], [-1, -1, 3, -1], [-1, 1, -1, -1], [-1, -1, -1, -1]]


@pytest.mark.parametrize(
    "kind,n,e,k,block",
    [
        ("topk", 37, 8, 2, 16),  # A=74: five blocks, the last partial
        ("topk", 50, 8, 6, None),
        ("topk", 9, 1, 1, 4),  # one expert
        ("one_expert", 33, 5, 1, 8),
        ("empty_experts", 40, 6, 2, 32),
        ("expert_choice", 30, 4, 2, 16),
        ("topk", 5, 3, 0, None),  # no assignments at all
    ],
)
def test_metadata_matches_stable_argsort(kind, n, e, k, block):
    gen = torch.Generator().manual_seed(n + e + k)
    token_A, expert_A = assignments(kind, n, e, max(k, 1), gen)
    if k == 0:
        token_A, expert_A = token_A[:0], expert_A[:0]
    got = routing_metadata(token_A, expert_A, n, e, block=block)
    ref = routing_metadata_reference(token_A, expert_A, n, e)
    for field in ("perm_P", "token_P", "counts_E", "offsets_E", "pos_NE"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), f"{field} differs for {kind}"


def test_metadata_rejects_bad_assignments():
    with pytest.raises(ValueError, match="repeated"):
        routing_metadata(torch.tensor([0, 1, 0]), torch.tensor([1, 1, 1]), 2, 2)
    with pytest.raises(ValueError, match="experts in"):
        routing_metadata(torch.tensor([0, 1]), torch.tensor([0, 2]), 2, 2)
    with pytest.raises(ValueError, match="1-D"):
        routing_metadata(torch.tensor([0.0]), torch.tensor([0]), 1, 1)
    with pytest.raises(ValueError, match="power of two"):
        routing_metadata(torch.tensor([0]), torch.tensor([0]), 1, 1, block=3)


# -- dispatch / combine -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,n,d,e,k", [("topk", 300, 128, 8, 2), ("expert_choice", 24, 40, 4, 2)])
def test_dispatch_combine_forward_and_grads(kind, n, d, e, k, dtype):
    gen = torch.Generator().manual_seed(1)
    token_A, expert_A = assignments(kind, n, e, k, gen)
    m = routing_metadata(token_A, expert_A, n, e)
    a = token_A.numel()
    x64 = torch.randn(n, d, generator=gen, dtype=torch.float64)
    rows64 = torch.randn(a, d, generator=gen, dtype=torch.float64)
    w64 = torch.rand(a, generator=gen, dtype=torch.float64)
    g_rows = torch.randn(a, d, generator=gen, dtype=torch.float64)
    g_y = torch.randn(n, d, generator=gen, dtype=torch.float64)

    def run(disp, comb, dt):
        x, rows = leaf(x64, dt), leaf(rows64, dt)
        w = leaf(w64, torch.float64 if dt == torch.float64 else torch.float32)
        xs = disp(x)
        y = comb(rows, w)
        torch.autograd.backward([xs, y], [g_rows.to(dt), g_y.to(y.dtype)])
        return [xs.detach(), y.detach(), x.grad, rows.grad, w.grad]

    got = run(lambda x: dispatch(x, m), lambda r, w: combine(r, w, m), dtype)
    ref_d = lambda x: dispatch_reference(x, m.token_P)  # noqa: E731
    ref_c = lambda r, w: combine_reference(r, w, m.perm_P, m.token_P, n)  # noqa: E731
    ref64 = run(ref_d, ref_c, torch.float64)
    same = run(ref_d, ref_c, dtype)
    assert torch.equal(got[0], same[0]), "dispatch must copy rows exactly"
    for name, g, r, s in zip(["x_sorted", "y", "dx", "drows", "dweight"], got, ref64, same):
        assert_near(name, g, r, s, dtype)


# -- grouped matmul ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind,gather,scatter",
    [
        ("empty_experts", False, False),
        ("one_expert", True, False),
        ("topk", True, True),
        ("expert_choice", False, True),
    ],
)
def test_grouped_mm_forward_and_grads(kind, gather, scatter, dtype):
    n, kdim, mdim, e = 70, 48, 40, 6
    gen = torch.Generator().manual_seed(2)
    token_A, expert_A = assignments(kind, n, e, 2, gen)
    meta = routing_metadata(token_A, expert_A, n, e)
    a = token_A.numel()
    x64 = torch.randn(n if gather else a, kdim, generator=gen, dtype=torch.float64)
    w64 = torch.randn(e, kdim, mdim, generator=gen, dtype=torch.float64) / kdim**0.5
    gy = torch.randn(a, mdim, generator=gen, dtype=torch.float64)
    counts = meta.counts_E.tolist()

    def reference(x, w):
        xs = x[meta.token_P.long()] if gather else x
        y = grouped_mm_reference(xs, w, counts)
        if scatter:
            y = y.new_zeros(y.shape).index_copy(0, meta.perm_P.long(), y)
        return y

    def run(fn, dt):
        x, w = leaf(x64, dt), leaf(w64, dt)
        y = fn(x, w)
        y.backward(gy.to(dt))
        return [y.detach(), x.grad, w.grad]

    got = run(lambda x, w: grouped_mm(x, w, meta, gather_tokens=gather, scatter_assignments=scatter), dtype)
    for name, g, r, s in zip(["y", "dx", "dw"], got, run(reference, torch.float64), run(reference, dtype)):
        assert_near(f"{kind} {name}", g, r, s, dtype)


# -- the whole MoE feed-forward ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind,n,d,f,e,k",
    [
        ("topk", 48, 32, 48, 8, 2),
        ("topk", 21, 24, 40, 8, 6),  # N*k = 126: no block multiple
        ("topk", 40, 16, 24, 4, 1),
        ("empty_experts", 30, 32, 16, 6, 2),
        ("one_expert", 70, 16, 32, 4, 1),  # two row tiles on one expert
        ("expert_choice", 32, 24, 24, 4, 2),  # tokens with zero and several rows
    ],
)
def test_moe_ffn_matches_reference(kind, n, d, f, e, k, dtype):
    check_moe_ffn(kind, n, d, f, e, k, dtype, seed=3)


def test_moe_ffn_bitwise_reproducible():
    check_moe_ffn("expert_choice", 40, 32, 32, 4, 2, torch.float16, seed=4, rerun=True)


def test_moe_ffn_no_assignments_and_bad_input():
    x = torch.randn(5, 8)
    ws = torch.randn(2, 8, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    empty = torch.zeros(0, dtype=torch.long)
    assert torch.equal(moe_ffn_triton(x, empty, empty, torch.zeros(0), *ws), torch.zeros(5, 8))
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="share one dtype"):
        moe_ffn_triton(x.half(), one, one, torch.ones(1), *ws)
    with pytest.raises(ValueError, match="w_down_EFD"):
        moe_ffn_triton(x, one, one, torch.ones(1), ws[0], ws[1], ws[2].transpose(1, 2))
    with pytest.raises(ValueError, match="weight_A"):
        moe_ffn_triton(x, one, one, torch.ones(2), *ws)


def test_moe_ffn_under_cpu_autocast_matches_bf16_reference():
    gen = torch.Generator().manual_seed(5)
    token_A, expert_A = assignments("topk", 16, 4, 2, gen)
    x, w, ws = ffn_inputs(16, 16, 16, 4, token_A.numel(), gen)
    args = (x.float(), token_A, expert_A, w.float(), *(t.float() for t in ws))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe_ffn_triton(*args)
    ref = moe_ffn_reference(x.bfloat16(), token_A, expert_A, w.float(), *(t.bfloat16() for t in ws))
    assert got.dtype == torch.bfloat16
    assert_near("autocast y", got, moe_ffn_reference(x, token_A, expert_A, w, *ws), ref, torch.bfloat16)


def test_interpreter_env_var_set_globally_still_works():
    """With TRITON_INTERPRET=1 set before triton is imported, the kernels still run and agree."""
    code = (
        "import torch; from causal_moe_kernels.moe_ffn import moe_ffn_triton; from causal_moe_kernels.reference import moe_ffn_reference\n"
        "g = torch.Generator().manual_seed(0); x = torch.randn(6, 16, generator=g)\n"
        "ws = [torch.randn(3, 16, 16, generator=g) / 4 for _ in range(3)]\n"
        "t = torch.arange(6).repeat_interleave(2); e = torch.tensor([0, 1, 1, 2, 0, 2, 2, 1, 0, 1, 1, 0]); w = torch.rand(12, generator=g)\n"
        "d = (moe_ffn_triton(x, t, e, w, *ws) - moe_ffn_reference(x, t, e, w, *ws)).abs().max().item()\n"
        "assert d < 1e-5, d\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": SOURCE_PATH}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_interpreted_launch_leaves_triton_unpatched():
    """The interpreter patches triton.language while a CPU kernel runs, and must undo it all."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    core_before = {k: getattr(tl.core, k) for k in dir(tl.core)}
    tensor_before = dict(vars(tl.core.tensor))
    call_before = JITFunction.__call__
    routing_metadata(torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1]), 2, 2)
    assert [k for k, v in core_before.items() if getattr(tl.core, k) is not v] == []
    assert [k for k, v in tensor_before.items() if vars(tl.core.tensor).get(k) is not v] == []
    assert JITFunction.__call__ is call_before


# -- MoELayer(backend="triton") == backend="torch" --------------------------------------

ROUTERS = [
    ("topk", {"top_k": 2}, True),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0}, True),
    ("expert_choice", {"capacity_factor": 1.0}, True),
    ("ec_threshold", {}, True),
    ("ec_predictor", {}, True),
    ("ec_predictor", {}, False),  # eval mode: the predictor routes (tokens may get no expert)
]


@pytest.mark.parametrize(
    "router,options,training", ROUTERS, ids=[f"{r}-{'train' if t else 'eval'}" for r, _, t in ROUTERS]
)
def test_layer_triton_equals_torch(router, options, training):
    from moe import MoELayer

    layer_torch = MoELayer(32, 48, 4, router=router, backend="torch", **options).train(training)
    layer_triton = copy.deepcopy(layer_torch)
    layer_triton.backend = "triton"
    x = torch.randn(2, 16, 32)
    gy = torch.randn(2, 16, 32)
    results = []
    for layer in (layer_torch, layer_triton):
        xi = x.clone().requires_grad_()
        y, routing = layer(xi, return_routing=True)
        ((y * gy).sum() + routing.aux_loss).backward()
        grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
        results.append((y.detach(), xi.grad, grads, routing.num_assignments))
    (y0, dx0, g0, a0), (y1, dx1, g1, a1) = results
    assert a0 == a1
    assert_near("y", y1, y0)
    assert_near("dx", dx1, dx0)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_near(name, g1[name], g0[name])


def test_auto_backend_is_torch_on_cpu():
    from moe.experts import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) is moe_ffn_reference
    assert resolve_backend("triton") is moe_ffn_triton


# -- broader sweep (slow) ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,k", [("topk", 6), ("topk", 2), ("expert_choice", 2), ("empty_experts", 1)])
def test_moe_ffn_sweep_slow(kind, k, dtype):
    check_moe_ffn(kind, 256, 128, 96, 8, k, dtype, seed=6)


# -- GPU (skipped without CUDA) ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind,k", [("topk", 6), ("expert_choice", 2), ("empty_experts", 2)])
def test_moe_ffn_cuda_matches_reference(kind, k, dtype):
    check_moe_ffn(kind, 1000, 256, 384, 8, k, dtype, seed=7, device="cuda", rerun=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,e,k", [(16384, 64, 6), (8192, 8, 2), (100, 64, 6)])
def test_metadata_and_combine_cuda_match_reference(n, e, k):
    gen = torch.Generator().manual_seed(8)
    token_A, expert_A = (t.cuda() for t in assignments("topk", n, e, k, gen))
    got = routing_metadata(token_A, expert_A, n, e)
    ref = routing_metadata_reference(token_A, expert_A, n, e)
    for field in ("perm_P", "token_P", "counts_E", "offsets_E", "pos_NE"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), f"{field} differs on CUDA"
    rows = torch.randn(n * k, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n * k, device="cuda")
    assert torch.equal(dispatch(rows[:n], got), rows[:n][got.token_P.long()])
    y = combine(rows, w, got)
    # float64 index_add as the reference: its atomics reorder float64 sums only (dense M would be 13 GB)
    ref_y = torch.zeros(n, 256, device="cuda", dtype=torch.float64)
    ref_y.index_add_(0, ref.token_P.long(), rows.double() * w.double()[ref.perm_P.long(), None])
    assert_near("combine cuda", y, ref_y, None, torch.bfloat16)
