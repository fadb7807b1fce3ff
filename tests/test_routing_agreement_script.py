"""experiments/routing_agreement.py end to end at the quick size: one router trained with the
router study's row config, its paths measured, JSON and markdown written."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import routing_agreement  # noqa: E402


@pytest.mark.slow
def test_quick_run_trains_measures_and_replays_the_served_routing(tmp_path):
    common = ["--routers", "topk_aux", "expert_choice", "--workers", "1", "--runs", str(tmp_path / "runs")]
    routing_agreement.main(["--quick", "train", *common])
    out = tmp_path / "agreement.json"
    result = routing_agreement.main(
        ["--quick", "measure", *common, "--windows", "8", "--batch-size", "8", "--json", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    topk, ec = result["rows"]
    assert topk["decoding"] == "KV-cache decoding, one token at a time" and "prefix" in ec["decoding"]
    assert topk["agreement"]["fp32_tf_vs_fp32_decode"]["share"] == 1.0  # causal and decode-consistent
    assert ec["agreement"]["fp32_tf_vs_fp32_decode"]["share"] < 0.9  # expert choice leaks
    for row in result["rows"]:
        for name in routing_agreement.BF16_PATHS:  # the replayed trainer routes exactly what was served
            assert row["agreement"][f"replayed_vs_{name}_decode"]["share"] == 1.0
        assert row["agreement"]["fp32_tf_vs_fp32_decode"]["pairs"] == 8 * 32 * 2  # windows x positions x layers
        # the training run's own final evaluation (the same 8 windows): the exported model is the trained one
        assert row["training"]["causal_loss"] == pytest.approx(row["loss"]["fp32_decode"], abs=1e-5)
        assert row["training"]["teacher_forced_loss"] == pytest.approx(row["loss"]["fp32_tf"], abs=1e-5)
    # replaying expert choice's causal routing brings the trainer to what decoding served
    gap = ec["logprob_gap"]
    assert gap["fp32_replay_bf16_vs_bf16_decode"][0] < gap["fp32_tf_vs_bf16_decode"][0]
    table = out.with_suffix(".md").read_text()
    assert table.count("| topk_aux |") == 2 and table.count("| expert_choice |") == 2
