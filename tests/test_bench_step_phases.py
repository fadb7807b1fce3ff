"""experiments/bench_step_phases.py measures what it says: its phases are the loop's step (the
same weights after them, bit for bit), its torch-AdamW baseline is the loop's numbers (the
loop's ``BlockedAdamW`` changes no bit of a training run), and each ratio divides by the dense
row of its own variant. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from extras import needs
from helpers import SMALL_RUN

from experiments import bench_step_phases as bench
from experiments.timing import Phases
from moe.routing import Router
from moe.training.config import TrainConfig
from moe.training.distributed import setup_distributed
from moe.training.loop import prepare, train_step


def session(router: str = "topk"):
    s = prepare(TrainConfig.flat(steps=10, router=router, **SMALL_RUN), None, setup_distributed("cpu"))
    s.place.model.train()
    return s


def weights(s) -> list[torch.Tensor]:
    return [p.detach().clone() for p in s.place.model.parameters()]


@pytest.mark.parametrize("router", ["topk", "ec_threshold"])
def test_phased_step_is_the_loops_step(router):
    stepped, phased = session(router), session(router)
    for step in (1, 2, 3):
        train_step(stepped, step)
        phases = Phases()
        bench.phased_step(phased, step, phases)
    assert all(torch.equal(a, b) for a, b in zip(weights(stepped), weights(phased)))
    assert list(phases.laps)[:3] == ["data (lr, batch, zero_grad)", "forward", "backward"]


def test_torch_adamw_baseline_trains_to_the_same_bits():
    blocked, torchs = session(), session()
    bench.use_torch_adamw(torchs)
    assert type(torchs.optimizer) is torch.optim.AdamW and type(blocked.optimizer) is not torch.optim.AdamW
    for step in (1, 2, 3):
        train_step(blocked, step)
        train_step(torchs, step)
    assert all(torch.equal(a, b) for a, b in zip(weights(blocked), weights(torchs)))


def test_ratios_divide_each_variant_by_its_dense_row():
    names = ["dense", "topk_aux", "dense torch-AdamW compiled", "topk_aux torch-AdamW compiled"]
    steps = {k: {"wall_s": w, "cpu_s": c} for k, w, c in zip(names, (0.1, 0.2, 0.05, 0.1), (0.1, 0.125, 0.08, 0.1))}
    r = bench.add_ratios(steps, dict.fromkeys(names, 768))
    assert r["topk_aux"]["wall_vs_dense"] == pytest.approx(0.5)
    assert r["topk_aux"]["cpu_vs_dense"] == pytest.approx(0.8)
    assert r["topk_aux torch-AdamW compiled"]["cpu_vs_dense"] == pytest.approx(0.8)
    assert r["topk_aux torch-AdamW compiled"]["cpu_vs_eager_dense"] == pytest.approx(1.0)
    assert r["dense"]["tokens_per_s_cpu"] == pytest.approx(7680)


def test_shrunk_rows_compare_with_the_shrunk_dense_row():
    """A shrunk run (``--shrunk``) has its own tokens a step and is divided by the shrunk dense
    row, never by the full-width one; the fixed-cost table takes each gap at its own widths."""
    names = ["dense", "topk_aux", "dense shrunk", "topk_aux shrunk"]
    steps = {k: {"wall_s": c, "cpu_s": c} for k, c in zip(names, (0.100, 0.125, 0.004, 0.009))}
    r = bench.add_ratios(steps, {"dense": 768, "topk_aux": 768, "dense shrunk": 16, "topk_aux shrunk": 16})
    assert r["topk_aux shrunk"]["cpu_vs_dense"] == pytest.approx(4 / 9)
    assert r["topk_aux shrunk"]["cpu_vs_eager_dense"] == pytest.approx(4 / 9)
    assert r["topk_aux shrunk"]["tokens_per_s_cpu"] == pytest.approx(16 / 0.009)
    row = next(line for line in bench.fixed_cost_table(r) if line.startswith("| topk_aux |"))
    assert row == "| topk_aux | 125.00 | +25.00 | 9.00 | +5.00 | 0.20 |"


@needs("shakespeare", "study")  # the rows train on Shakespeare BPE
def test_shrunk_session_keeps_the_rows_layers_and_routers():
    info = setup_distributed("cpu")
    for label in ("dense", "expert_threshold"):
        full, small = (bench.session("baby", label, False, info, shrunk=shrunk).place.model.cfg for shrunk in (0, 1))
        assert (small.d_model, small.max_seq_len) == (16, 8)
        assert (small.n_layers, small.num_experts, small.moe_every) == (full.n_layers, full.num_experts, full.moe_every)
        assert (small.router, small.router_options, small.vocab_size) == (
            full.router,
            full.router_options,
            full.vocab_size,
        )
    assert (small.moe_d_ff, bench.session("baby", "dense", False, info, shrunk=True).place.model.cfg.d_ff) == (16, 32)


def test_operator_profile_counts_each_step_once():
    """Two profiled steps of a model are reported per step: the model's matmuls (each layer's
    forward and backward) come out as whole calls per step, not twice as many."""
    ops = bench.operator_profile({"topk": session()}, steps=2)["topk"]
    per_step = ops["aten::mm"]["calls"]
    assert per_step == int(per_step) and per_step > 0
    one = bench.operator_profile({"topk": session()}, steps=1)["topk"]
    assert one["aten::mm"]["calls"] == per_step


def test_operator_rows_put_the_largest_growth_first():
    ops = {
        "dense": {"aten::mm": {"cpu_ms": 10.0, "calls": 60}, "aten::add": {"cpu_ms": 1.0, "calls": 20}},
        "topk_aux": {
            "aten::mm": {"cpu_ms": 12.0, "calls": 300},
            "aten::add": {"cpu_ms": 0.5, "calls": 20},
            "aten::topk": {"cpu_ms": 3.0, "calls": 8},
        },
    }
    lines = bench.operator_rows(ops)
    assert "own CPU ms per step 11.0 -> 15.5, operator calls 80 -> 328" in lines[1]
    body = [line for line in lines if line.startswith("| `")]
    assert [line.split("`")[1] for line in body] == ["aten::topk", "aten::mm", "aten::add"]
    assert body[0].endswith("| +3.00 |") and body[2].endswith("| -0.50 |")


def test_frozen_routing_returns_one_forwards_routing_without_gradient():
    """After ``freeze_routing`` every router gives the assignments of the forward it froze, to
    any input, with no aux loss and no gradient into its gate; the rest of the step trains."""
    s = session()
    routers = [m for m in s.place.model.modules() if isinstance(m, Router)]
    first = {r: None for r in routers}
    handles = [r.register_forward_hook(lambda m, i, out: first.__setitem__(m, out)) for r in routers]
    bench.freeze_routing(s, 1)
    for h in handles:
        h.remove()
    expert_weights = [p for n, p in s.place.model.named_parameters() if "experts" in n]
    before = [p.detach().clone() for p in expert_weights]
    train_step(s, 2)
    for r in routers:
        x = torch.randn(2, 5, r.d_model)
        again = r(x)
        assert torch.equal(again.expert, first[r].expert) and torch.equal(again.token, first[r].token)
        assert torch.equal(again.weight, first[r].weight) and not again.weight.requires_grad
        assert float(again.aux_loss) == 0.0
        assert all(p.grad is None or not p.grad.any() for p in r.gate.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, expert_weights))


def test_a_variant_without_a_dense_row_of_its_own_divides_by_eager_dense():
    steps = {"dense": {"wall_s": 0.1, "cpu_s": 0.1}, "topk_aux frozen-routing": {"wall_s": 0.2, "cpu_s": 0.125}}
    r = bench.add_ratios(steps, dict.fromkeys(steps, 768))
    assert r["topk_aux frozen-routing"]["cpu_vs_dense"] == pytest.approx(0.8)
