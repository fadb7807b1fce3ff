"""experiments/leakage_gap.py end to end: outputs, and (slow) the --quick acceptance numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "experiments" / "leakage_gap.py")


def run(args, timeout):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_short_run_writes_json_table_and_figure(tmp_path):
    out = tmp_path / "gap.json"
    run(["--quick", "--corpora", "canary", "--routers", "topk", "expert_choice", "--canary-steps", "20",
         "--workers", "1", "--json", str(out)], timeout=300)
    result = json.loads(out.read_text())
    rows = {r["router"]: r for r in result["routers"]}
    assert set(rows) == {"topk", "expert_choice"}
    for r in rows.values():
        for key in ("teacher_forced_loss", "causal_loss", "leakage_gap", "train_time_s", "corpus"):
            assert key in r, key
        assert r["leakage_gap"] == pytest.approx(r["causal_loss"] - r["teacher_forced_loss"], abs=1e-9)
        assert r["steps"] == 20 and len(r["loss_curve"]) == 20
    # Dropless top-k is causal: the prefix forward reproduces the full forward.
    assert abs(rows["topk"]["leakage_gap"]) < 1e-5, rows["topk"]
    table = out.with_suffix(".md").read_text()
    assert "| canary | expert_choice |" in table and "| canary | topk |" in table
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_quick_run_shows_the_expert_choice_leak(tmp_path):
    out = tmp_path / "quick.json"
    run(["--quick", "--json", str(out)], timeout=900)
    rows = {(r["corpus"], r["router"]): r for r in json.loads(out.read_text())["routers"]}
    assert rows[("canary", "expert_choice")]["leakage_gap"] > 0.02, rows[("canary", "expert_choice")]
    for corpus in ("canary", "text"):
        assert abs(rows[(corpus, "topk")]["leakage_gap"]) < 1e-3, rows[(corpus, "topk")]
