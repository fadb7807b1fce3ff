"""torch.compile of MoELayer: one graph (fullgraph=True), no host read, equal to eager.

Two routers must compile: dropless ``topk`` and ``capacity`` with ``capacity_scope="prefix"``.
While traced, the capacity router returns the fixed-size routing form and the torch data path
is one opaque operator (``torch.ops.causal_moe_kernels.sorted_moe_ffn``, the sorted path with an output shape
known from its inputs); both are checked here against their eager counterparts, and the
compiled layer against the eager layer.

The default tests trace with AOTAutograd and run the traced graphs eagerly (``aot_eager``):
the forward and backward graphs are what inductor would compile, in seconds. The inductor
test (C++ code generation, about 30 s a layer on 2 loaded cores) is slow.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import moe
from causal_moe_kernels.reference import moe_ffn_reference
from moe.experts import FusedSwiGLUExperts
from moe.model import MoETransformer, preset
from moe.parallel.compile import compile_blocks

LAYERS = [
    ("topk", {"top_k": 2}),
    ("capacity", {"top_k": 2, "capacity_factor": 0.75, "capacity_scope": "prefix"}),
]
# ops whose output size or value is read on the host: any of them is a host synchronisation
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount")
# the traced graphs run the same sorted data path as eager; what differs is the code around it
# (inductor may fuse and reorder the routers' and norms' fp32 arithmetic): a few ulps relative
TOL = 1e-5


def recording_backend(graphs: list):
    """An AOTAutograd backend that keeps each forward and backward graph and runs it eagerly."""

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def run(layer, x, fn=None):
    """Output and the gradients of every parameter and of x for the loss sum(y^2)."""
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    y = (layer if fn is None else fn)(x)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]


def assert_close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        d = (g - w).abs()
        rel = d.max() / w.abs().max().clamp_min(1e-30)
        assert rel < TOL, f"{what} tensor {i}: max {d.max():.3e} mean {d.mean():.3e} relative {rel:.3e}"


@pytest.mark.parametrize("name,opts", LAYERS)
def test_layer_is_one_graph_without_host_reads_and_equals_eager(name, opts):
    torch._dynamo.reset()
    layer = moe.MoELayer(16, 32, 4, router=name, **opts)
    x = torch.randn(2, 9, 16)
    graphs: list = []
    got = run(layer, x, torch.compile(layer, backend=recording_backend(graphs), fullgraph=True))
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    for gm in graphs:
        reads = [str(n.target) for n in gm.graph.nodes if any(h in str(n.target) for h in HOST_READS)]
        assert not reads, f"host reads in the traced graph: {reads}"
    assert_close(got, run(layer, x), f"{name} compiled vs eager")


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", LAYERS)
def test_layer_compiled_by_inductor_equals_eager(name, opts):
    torch._dynamo.reset()
    layer = moe.MoELayer(16, 32, 4, router=name, **opts)
    x = torch.randn(2, 9, 16)
    assert_close(run(layer, x, torch.compile(layer, fullgraph=True)), run(layer, x), f"{name} inductor vs eager")


def test_fixed_size_capacity_routing_equals_compact(monkeypatch):
    router = moe.build_router(
        "capacity", d_model=8, num_experts=4, top_k=2, capacity_factor=0.5, capacity_scope="prefix"
    )
    x = torch.randn(3, 7, 8)
    compact = router(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fixed = router(x)
    assert fixed.valid is not None and fixed.token.numel() == 3 * 7 * 2
    assert 0 < compact.num_assignments < fixed.token.numel(), "the case must drop some assignments"
    assert (fixed.weight[~fixed.valid] == 0).all()
    again = fixed.compact()
    for field in ("token", "expert", "weight"):
        assert torch.equal(getattr(again, field), getattr(compact, field)), field
    assert torch.equal(fixed.mask(), compact.mask())
    assert torch.equal(fixed.dense(), compact.dense())
    assert torch.equal(fixed.experts_per_token(), compact.experts_per_token())
    assert fixed.num_assignments == compact.num_assignments
    assert torch.equal(fixed.stats["tokens_per_expert"], compact.stats["tokens_per_expert"])
    assert abs(float(fixed.stats["dropped_fraction"]) - float(compact.stats["dropped_fraction"])) < 1e-6


def test_traced_operator_equals_the_eager_sorted_path():
    """The operator the traced graph calls, on experts with no token, tokens with none, a token
    with three experts and rows of weight 0 (the fixed-size form's dropped candidates): output
    and every gradient equal eager autograd through the sorted path (float64: the written-out
    SwiGLU backward orders its products as autograd does up to rounding)."""
    n, d, f, e = 6, 8, 12, 4
    token_A = torch.tensor([0, 0, 1, 3, 3, 3, 5])
    expert_A = torch.tensor([1, 2, 1, 0, 1, 2, 1])
    weight = torch.tensor([0.5, 0.5, 1.0, 0.2, 0.0, 0.8, 0.0], dtype=torch.float64)
    x = torch.randn(n, d, dtype=torch.float64)
    ws = [
        torch.randn(e, d, f, dtype=torch.float64),
        torch.randn(e, d, f, dtype=torch.float64),
        torch.randn(e, f, d, dtype=torch.float64),
    ]
    outs = []
    for fn in (moe_ffn_reference, lambda *a: torch.ops.causal_moe_kernels.sorted_moe_ffn(*a)[0]):
        leaves = [t.clone().requires_grad_(True) for t in (x, weight, *ws)]
        y = fn(leaves[0], token_A, expert_A, leaves[1], *leaves[2:])
        (y * torch.arange(n * d, dtype=torch.float64).view(n, d).sin()).sum().backward()
        outs.append([y.detach()] + [t.grad for t in leaves])
    assert outs[0][0][[2, 4]].abs().max() == 0, "tokens 2 and 4 have no expert: zero output"
    for i, (a, b) in enumerate(zip(*outs)):
        diff = (a - b).abs()
        assert diff.max() <= 1e-12 * b.abs().max(), f"tensor {i}: max {diff.max():.3e} mean {diff.mean():.3e}"


def test_traced_operator_takes_no_assignment():
    """Traced, the layer calls the operator before looking at A (under
    ``capture_dynamic_output_shape_ops`` A is nonzero's size, unknown until run time): with no
    assignment it returns zeros and zero gradients, as the eager path does."""
    n, d, f, e = 4, 8, 6, 3
    leaves = [torch.randn(n, d), torch.randn(e, d, f), torch.randn(e, d, f), torch.randn(e, f, d)]
    leaves = [t.requires_grad_(True) for t in leaves]
    none = torch.zeros(0, dtype=torch.long)
    weight = torch.zeros(0, requires_grad=True)
    y = torch.ops.causal_moe_kernels.sorted_moe_ffn(leaves[0], none, none, weight, *leaves[1:])[0]
    (y * torch.randn(n, d)).sum().backward()
    assert y.shape == (n, d) and y.abs().max() == 0
    assert all(t.grad is not None and t.grad.abs().max() == 0 for t in leaves)


def test_operators_fake_kernels_match_real_ones_on_strided_experts():
    """The fake (meta) kernels the compiler plans with give the real outputs' shapes and strides,
    also for the experts of a transformers model: transposed views of its fused [E, 2F, D] and
    [E, D, F] tensors (``FusedSwiGLUExperts``). An ``empty_like`` fake keeps those inputs'
    transposed strides while the real operator returns contiguous gradients: inductor then
    fails its stride assertion (seen with --compile on --hf-model)."""
    e, d, f, n = 3, 8, 5, 6
    fused = FusedSwiGLUExperts(torch.nn.Parameter(torch.randn(e, 2 * f, d)), torch.nn.Parameter(torch.randn(e, d, f)))
    ws = (fused.w_gate, fused.w_up, fused.w_down)
    assert not any(w.is_contiguous() for w in ws)
    token_A = torch.tensor([0, 0, 1, 4, 5, 5])
    expert_A = torch.tensor([0, 2, 1, 0, 1, 2])
    x = torch.randn(n, d)
    weight = torch.rand(6)
    forward = (x, token_A, expert_A, weight, *ws)
    torch.library.opcheck(
        torch.ops.causal_moe_kernels.sorted_moe_ffn.default, forward, test_utils=("test_schema", "test_faketensor")
    )
    saved = torch.ops.causal_moe_kernels.sorted_moe_ffn(*forward)[1:]
    backward = (torch.randn(n, d), *forward, *saved)
    torch.library.opcheck(
        torch.ops.causal_moe_kernels.sorted_moe_ffn_backward.default,
        backward,
        test_utils=("test_schema", "test_faketensor"),
    )
    real = torch.ops.causal_moe_kernels.sorted_moe_ffn_backward(*backward)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.causal_moe_kernels.sorted_moe_ffn_backward(*(mode.from_tensor(t) for t in backward))
    for i, (r, k) in enumerate(zip(real, fake, strict=True)):
        assert (r.shape, r.stride()) == (k.shape, k.stride()), f"gradient {i}: real {r.stride()}, fake {k.stride()}"


def test_traced_graph_calls_the_sorted_operator_once_per_layer():
    """Not a dense all-experts product: the expert FLOPs of the compiled layer are the sorted
    path's (one moe_ffn forward and one backward operator, no [E, N, F] intermediate)."""
    torch._dynamo.reset()
    layer = moe.MoELayer(16, 32, 4, router="topk", top_k=2)
    graphs: list = []
    run(layer, torch.randn(2, 9, 16), torch.compile(layer, backend=recording_backend(graphs), fullgraph=True))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("causal_moe_kernels.sorted_moe_ffn.default") == 1, targets
    assert targets.count("causal_moe_kernels.sorted_moe_ffn_backward.default") == 1, targets


@pytest.mark.parametrize("name,opts", LAYERS)
def test_model_with_compiled_blocks_keeps_its_names_and_equals_eager(name, opts):
    torch._dynamo.reset()
    cfg = preset("tiny", router=name, router_options=opts)
    eager, compiled = MoETransformer(cfg, init_seed=3), MoETransformer(cfg, init_seed=3)
    graphs: list = []
    compile_blocks(compiled.blocks, fullgraph=True, backend=recording_backend(graphs))
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (eager, compiled):
        out = model(idx[:, :-1], idx[:, 1:])
        (out.loss + out.aux_loss).backward()
        results.append([out.loss.detach(), out.aux_loss.detach()] + [p.grad for p in model.parameters()])
    assert graphs, "the blocks were not compiled"
    assert_close(results[1], results[0], f"{name} model with compiled blocks vs eager")
