"""experiments/bench_study_shape.py measures what it says: the dense baseline does the MoE
layer's expert FLOPs, every layer phase runs the layer's own pieces, the ratios divide the
right baselines, and (slow) the script runs end to end. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import moe
from experiments import bench_study_shape as bench
from moe.model import SwiGLU


def test_layer_phases_run_and_the_baseline_has_the_experts_flops():
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 32, 4, router="topk", top_k=2)
    fns = bench.layer_phase_fns(layer, SwiGLU(16, 2 * 32), torch.randn(2, 8, 16))
    flops = {}
    for name, fn in fns.items():
        with FlopCounterMode(display=False) as counter:
            fn()
        flops[name] = counter.get_total_flops()
    assert flops["dense SwiGLU 512 (baseline)"] == flops["experts (per-expert SwiGLU)"] > 0, flops
    assert layer.experts.w_gate.grad is not None and layer.router.gate.weight.grad is not None


def test_step_ratios_divide_each_mode_by_its_dense_run():
    steps = {
        "dense": {"wall_s": 0.1, "cpu_s": 0.1},
        "topk": {"wall_s": 0.2, "cpu_s": 0.125},
        "dense compiled": {"wall_s": 0.05, "cpu_s": 0.08},
        "topk compiled": {"wall_s": 0.1, "cpu_s": 0.1},
    }
    r = bench.add_step_ratios(steps)
    assert r["topk"]["wall_tokens_per_s_vs_dense"] == pytest.approx(0.5)
    assert r["topk"]["cpu_tokens_per_s_vs_dense"] == pytest.approx(0.8)
    assert r["topk compiled"]["cpu_tokens_per_s_vs_dense"] == pytest.approx(0.8)
    assert r["topk compiled"]["cpu_tokens_per_s_vs_eager_dense"] == pytest.approx(1.0)
    assert r["dense"]["tokens_per_s_cpu"] == pytest.approx(bench.TOKENS / 0.1)


@pytest.mark.slow
def test_quick_run_writes_json_and_markdown(tmp_path):
    result = bench.main(["--quick", "--out-dir", str(tmp_path), "--label", "t"])
    written = json.loads(next(tmp_path.glob("bench_study_shape-*-t.json")).read_text())
    assert set(written["steps"]) == set(bench.ROUTERS) == set(result["steps"])
    assert next(tmp_path.glob("bench_study_shape-*-t.md")).read_text().startswith("# bench_study_shape")
