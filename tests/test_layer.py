"""MoELayer against a naive per-assignment loop (float64), a dense SwiGLU, and itself."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import ROUTER_CONFIGS, naive_moe

import moe
from moe.model import SwiGLU


def grads(module, *tensors):
    return [p.grad.clone() for p in module.parameters() if p.grad is not None] + [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("name,opts", ROUTER_CONFIGS)
def test_layer_matches_naive_loop_in_float64(name, opts):
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 12, 4, router=name, **opts).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    y, routing = layer(x, return_routing=True)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    got = grads(layer, x)
    assert routing.num_assignments > 0

    layer.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = naive_moe(layer, x_ref, layer.router(x_ref))
    (y_ref * gy).sum().backward()
    want = grads(layer, x_ref)

    diff = (y - y_ref).abs()
    assert diff.max() < 1e-10, f"output max {diff.max():.3e} mean {diff.mean():.3e}"
    assert len(got) == len(want)
    for (pname, _), g, w in zip(list(layer.named_parameters()) + [("x", None)], got, want):
        d = (g - w).abs()
        assert d.max() < 1e-10, f"grad {pname}: max {d.max():.3e} mean {d.mean():.3e}"


def test_one_expert_layer_equals_dense_swiglu():
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 16, 1, router="topk", top_k=1).double()
    dense = SwiGLU(8, 16).double()
    with torch.no_grad():
        dense.w_gate.weight.copy_(layer.experts.w_gate[0].T)
        dense.w_up.weight.copy_(layer.experts.w_up[0].T)
        dense.w_down.weight.copy_(layer.experts.w_down[0].T)
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    assert (layer(x) - dense(x)).abs().max() < 1e-12


def test_bitwise_reproducible_outputs_and_gradients():
    torch.manual_seed(0)
    layer = moe.MoELayer(32, 64, 8, router="capacity", top_k=2, capacity_factor=1.0)
    x = torch.randn(4, 33, 32)
    runs = []
    for _ in range(2):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        runs.append([y.detach()] + grads(layer, xi))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_tokens_routed_nowhere_get_zero_and_empty_routing_works():
    layer = moe.MoELayer(4, 8, 2, router="ec_threshold")
    with torch.no_grad():
        layer.router.ema_sum.fill_(2.0)  # threshold 2 > any probability: nothing is routed
        layer.router.ema_weight.fill_(1.0)
    y, routing = layer(torch.randn(2, 3, 4), return_routing=True)
    assert routing.num_assignments == 0
    assert torch.equal(y, torch.zeros(2, 3, 4))
    assert routing.stats["dropped_fraction"].item() == 1.0


def test_layer_accepts_built_router_and_checks_it():
    r = moe.build_router("expert_choice", d_model=8, num_experts=4)
    assert moe.MoELayer(8, 16, 4, router=r).router is r
    with pytest.raises(ValueError, match="router built for d_model=8, num_experts=4"):
        moe.MoELayer(8, 16, 2, router=r)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: moe.MoELayer(8, 16, 4, backend="cuda-magic"), "unknown backend 'cuda-magic'"),
        (lambda: moe.MoELayer(8, 16, 0), "num_experts must be a positive integer"),
        (lambda: moe.MoELayer(8, 0, 4), "d_ff must be a positive integer"),
        (lambda: moe.MoELayer(8, 16, 4, router="topk", top_k=5), "top_k must be an integer in"),
    ],
)
def test_bad_layer_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_layer_input():
    layer = moe.MoELayer(8, 16, 4)
    with pytest.raises(ValueError, match="expected floating-point features"):
        layer(torch.randint(0, 5, (2, 3, 8)))
    with pytest.raises(ValueError, match="expected last dimension D=8"):
        layer(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"expected input of shape \[B, T, D=8\]"):
        layer(torch.randn(6, 8))


def test_update_routers_reaches_every_router():
    model = torch.nn.Sequential(
        moe.MoELayer(4, 8, 2, router="topk", top_k=1, balance_rate=0.5),
        moe.MoELayer(4, 8, 2, router="ec_threshold", momentum=0.0),
    )
    with torch.no_grad():
        model[0].router.gate.weight.copy_(torch.tensor([[1.0] * 4, [0.0] * 4]))  # every token -> e0
    x = torch.ones(1, 6, 4)
    model[1](model[0](x))
    moe.update_routers(model)
    assert model[0].router.balance_bias.tolist() == [-0.5, 0.5]
    assert model[1].router.ema_weight.item() == 1.0


def test_layer_trains():
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 16, 4, router="topk", top_k=2)
    x, target = torch.randn(4, 8, 8), torch.randn(4, 8, 8)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        y, routing = layer(x, return_routing=True)
        loss = F.mse_loss(y, target) + routing.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_expert_without_tokens_gets_exactly_zero_gradient():
    torch.manual_seed(0)
    layer = moe.MoELayer(4, 8, 3, router="topk", top_k=1).double()
    with torch.no_grad():
        layer.router.gate.weight[2] = -100.0  # with positive inputs, expert 2 is never picked
    x = torch.rand(2, 5, 4, dtype=torch.float64) + 0.1
    y, routing = layer(x, return_routing=True)
    assert routing.stats["tokens_per_expert"][2] == 0
    y.sum().backward()
    for w in (layer.experts.w_gate, layer.experts.w_up, layer.experts.w_down):
        assert torch.equal(w.grad[2], torch.zeros_like(w.grad[2]))
        assert w.grad[:2].abs().sum() > 0


def test_bench_layer_times_equal_flops_and_equivalent_paths(tmp_path):
    """experiments/bench_layer.py times what it says: the dense baseline does the MoE's expert
    FLOPs, the layer and the naive loop compute the same function, the expert-only row runs
    the experts on the layer's own sorted rows; and the script runs end to end."""
    from torch.utils.flop_counter import FlopCounterMode

    from experiments import bench_layer

    n, d, f, e, k = 64, 16, 32, 4, 2
    argv = [
        "--tokens",
        str(n),
        "--d-model",
        str(d),
        "--d-ff",
        str(f),
        "--experts",
        str(e),
        "--top-k",
        str(k),
        "--reps",
        "1",
        "--threads",
        "1",
    ]
    layer, dense, x = bench_layer.build(bench_layer.parse_args(argv))
    paths = bench_layer.compared_paths(layer, dense, x)
    assert set(paths) == {"dense", "expert_matmuls_only", "moe_layer", "naive_mask_loop"}

    flops = {}
    for name, (fn, inp) in paths.items():
        with FlopCounterMode(display=False) as counter:
            fn(inp.detach().requires_grad_(True)).square().mean().backward()
        flops[name] = counter.get_total_flops()
    expert_flops = 9 * 2 * (n * k) * d * f  # 3 matmuls forward, 6 backward, over N*k assignments
    router_flops = 3 * 2 * n * d * e  # the gate: forward, input and weight gradients
    assert flops["dense"] == flops["expert_matmuls_only"] == expert_flops, flops
    assert flops["moe_layer"] == flops["naive_mask_loop"] == expert_flops + router_flops, flops

    with torch.no_grad():
        routing = layer.router(x)
        want = naive_moe(layer, x, routing)
        for name in ("moe_layer", "naive_mask_loop"):
            diff = (paths[name][0](x) - want).abs().max()
            assert diff < 1e-5, f"{name}: max diff {diff:.3e}"
        fn, x_sorted_AD = paths["expert_matmuls_only"]
        order_A = torch.argsort(routing.expert, stable=True)
        rows_AD = fn(x_sorted_AD) * routing.weight[order_A, None]
        y_ND = torch.zeros(n, d).index_add(0, routing.token[order_A], rows_AD)
        assert (y_ND.view_as(want) - want).abs().max() < 1e-5

    res = bench_layer.main([*argv, "--json", str(tmp_path / "bench.json")])
    saved = json.loads((tmp_path / "bench.json").read_text())
    for name in paths:
        assert saved[f"{name}_s"] == res[f"{name}_s"] > 0, name
