"""experiments/bench_grouped.py runs end to end on tiny shapes and its ratios divide what they
name (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from experiments import bench_grouped as bench


def test_quick_run_writes_every_configuration_and_consistent_ratios(tmp_path):
    result = bench.main(["--quick", "--out-dir", str(tmp_path), "--label", "t"])
    stem = f"bench_grouped-{result['date']}-cpu1-t"
    assert json.loads((tmp_path / f"{stem}.json").read_text())["results"] == result["results"]
    assert "grouped_mm / torch" in (tmp_path / f"{stem}.md").read_text()
    layer, model = result["results"]["baby layer"], result["results"]["baby model"]
    assert set(layer["ms"]) == {"dense", "torch", "grouped_mm"}
    assert set(model["ms"]) == {"dense model", "torch model", "grouped_mm model"}
    for shape in result["results"].values():
        for key, ratio in shape["ratios"].items():
            num, den = key.split(" / ")
            assert ratio["cpu"] == pytest.approx(shape["ms"][num]["cpu"] / shape["ms"][den]["cpu"])
            assert ratio["cpu_per_round_min"] <= ratio["cpu_per_round_median"] <= ratio["cpu_per_round_max"]


def test_dense_baseline_has_the_layers_active_width_and_backends_share_weights():
    s = bench.QUICK_SHAPES["baby"]
    modules, x = bench.layer_modules(s)
    dense, torch_layer, grouped = modules["dense"], modules["torch"], modules["grouped_mm"]
    assert x.shape == (s["batch"], s["seq"], s["d_model"])
    assert dense.w_gate.weight.shape == (s["top_k"] * s["d_ff"], s["d_model"])
    assert (torch_layer.backend, grouped.backend) == ("torch", "grouped_mm")
    assert all(a.equal(b) for a, b in zip(torch_layer.parameters(), grouped.parameters(), strict=True))
