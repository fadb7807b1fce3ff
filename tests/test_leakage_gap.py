"""The leakage gap: what it measures (on models with a known leak), experiments/leakage_gap.py
end to end on a tiny canary, and (slow) the --quick acceptance numbers."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import SOURCE_PATH
from torch import nn

import experiments.leakage_gap as leakage_gap
from moe.eval import evaluate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "experiments" / "leakage_gap.py")


def run(args, timeout):
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


class PeekingLM(nn.Module):
    """A "language model" whose prediction at position t is the token at t + ``peek``
    (certain, logit margin 100) and uniform where that position is not in the input.
    ``peek=1`` reads the future: the leak is total and known. ``peek=0`` reads only t."""

    def __init__(self, vocab: int, peek: int) -> None:
        super().__init__()
        self.vocab, self.peek = vocab, peek
        self.unused = nn.Parameter(torch.zeros(()))  # evaluate() reads the device from it

    def forward(self, idx_BT: torch.Tensor) -> SimpleNamespace:
        b, t = idx_BT.shape
        logits_BTV = torch.zeros(b, t, self.vocab)
        if t > self.peek:
            seen_BT = idx_BT[:, self.peek :]
            logits_BTV[:, : t - self.peek].scatter_(2, seen_BT.unsqueeze(-1), 100.0)
        return SimpleNamespace(logits=logits_BTV)


def test_gap_of_a_model_that_reads_the_next_token_is_the_information_it_took():
    """Teacher-forced, positions 0..T-2 see their target (loss ~0) and T-1 is uniform; decoded
    from prefixes, every position is the last one and uniform: gap = (T-1)/T * log V."""
    vocab, seq_len = 8, 8
    val = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(0))
    res = evaluate(PeekingLM(vocab, peek=1), val, seq_len, num_windows=64, batch_size=16)
    assert res["teacher_forced_loss"] == pytest.approx(math.log(vocab) / seq_len, abs=1e-6)
    assert res["causal_loss"] == pytest.approx(math.log(vocab), abs=1e-6)
    assert res["leakage_gap"] == pytest.approx((seq_len - 1) / seq_len * math.log(vocab), abs=1e-6)
    assert res["eval_positions"] == 64 * seq_len

    causal = evaluate(PeekingLM(vocab, peek=0), val, seq_len, num_windows=64, batch_size=16)
    assert causal["leakage_gap"] == 0.0 and causal["leakage_gap_se"] == 0.0
    # Stride 4 reads positions 3 and 7 only: one sees its target, the last does not.
    strided = evaluate(PeekingLM(vocab, peek=1), val, seq_len, num_windows=64, causal_stride=4, batch_size=16)
    assert strided["eval_positions"] == 64 * 2
    assert strided["leakage_gap"] == pytest.approx(math.log(vocab) / 2, abs=1e-6)


def test_short_canary_run_shows_the_expert_choice_leak_and_none_for_topk(tmp_path):
    """20 steps on the canary (V=8, T=8): expert choice, which lets each expert pick its tokens
    from the whole sequence, already decodes worse than it teacher-forces, many standard
    errors above zero; dropless top-k, causal, has no gap beyond float rounding."""
    out = tmp_path / "gap.json"
    run(
        [
            "--quick",
            "--corpora",
            "canary",
            "--routers",
            "topk",
            "expert_choice",
            "--canary-steps",
            "20",
            "--workers",
            "1",
            "--json",
            str(out),
        ],
        timeout=300,
    )
    result = json.loads(out.read_text())
    rows = {r["router"]: r for r in result["routers"]}
    assert set(rows) == {"topk", "expert_choice"}
    for r in rows.values():
        assert r["corpus"] == "canary" and r["steps"] == 20 and len(r["loss_curve"]) == 20
        assert r["eval_positions"] == 1024 * 8  # the --quick canary budget: 1024 windows, every position
    ec, topk = rows["expert_choice"], rows["topk"]
    assert ec["leakage_gap"] > 0.002 and ec["leakage_gap"] > 4 * ec["leakage_gap_se"], ec
    assert ec["causal_loss"] > ec["teacher_forced_loss"], ec
    assert abs(topk["leakage_gap"]) < 1e-6 and topk["leakage_gap_se"] < 1e-6, topk
    assert topk["causal_loss"] == pytest.approx(topk["teacher_forced_loss"], abs=1e-6)
    assert topk["train_serve_agreement"] == ec["train_serve_agreement"] == 1.0  # both route alike in either mode
    table = out.with_suffix(".md").read_text()
    assert "| canary | expert_choice |" in table and "| canary | topk |" in table
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_the_text_corpus_warms_up_over_a_tenth_of_its_steps_at_most_100():
    args = argparse.Namespace(seed=0, data="stdlib", canary_lr=3e-3)
    quick = leakage_gap.corpus_config("text", leakage_gap.QUICK["text"], args)  # 100 steps
    full = leakage_gap.corpus_config("text", leakage_gap.FULL["text"], args)  # 1,500 steps
    assert (quick["steps"], quick["warmup_steps"]) == (100, 10)
    assert (full["steps"], full["warmup_steps"]) == (1500, 100)


def test_the_rendered_train_mode_gap_is_causal_minus_train_mode(tmp_path, monkeypatch):
    """Written out by hand for one row: causal 2.25, train-mode 2.0 (its teacher-forced loss with
    training routing): the train-mode gap is +0.25 in the JSON and the table."""
    monkeypatch.setattr(leakage_gap, "plot", lambda *args: None)  # the figure is not checked here
    row = {
        "router": "expert_choice",
        "router_name": "expert_choice",
        "router_options": {"capacity_factor": 1.0},
        "corpus": "canary",
        "teacher_forced_loss": 2.0,
        "causal_loss": 2.25,
        "leakage_gap": 0.25,
        "leakage_gap_se": 0.01,
        "train_mode_loss": 2.0,
        "eval_positions": 64,
        "steps": 10,
        "train_time_s": 1.0,
        "loss_curve": [2.5, 2.25],
    }
    result = {"quick": True, "wall_time_s": 60.0, "budgets": {"canary": {}}, "routers": [row]}
    table = leakage_gap.render(result, tmp_path / "gap.json")
    (stored,) = json.loads((tmp_path / "gap.json").read_text())["routers"]
    assert stored["train_mode_gap"] == 0.25
    assert "| 2.0000 | +0.2500 | 64 | 10 | 1 |" in table, table


@pytest.mark.slow
def test_quick_run_shows_the_expert_choice_leak(tmp_path):
    out = tmp_path / "quick.json"
    run(["--quick", "--json", str(out)], timeout=900)
    rows = {(r["corpus"], r["router"]): r for r in json.loads(out.read_text())["routers"]}
    assert rows[("canary", "expert_choice")]["leakage_gap"] > 0.02, rows[("canary", "expert_choice")]
    for corpus in ("canary", "text"):
        assert abs(rows[(corpus, "topk")]["leakage_gap"]) < 1e-3, rows[(corpus, "topk")]


@pytest.mark.slow
def test_update_of_one_corpus_keeps_the_other_corpus_rows_and_budgets(tmp_path):
    out = tmp_path / "gap.json"
    common = ["--canary-steps", "10", "--text-steps", "10", "--workers", "1"]
    run(["--quick", "--routers", "topk", *common, "--json", str(out)], timeout=600)
    before = json.loads(out.read_text())
    run(["--update", str(out), "--routers", "expert_choice", "--corpora", "text", *common], timeout=600)
    after = json.loads(out.read_text())
    assert after["budgets"] == before["budgets"] and set(after["budgets"]) == {"canary", "text"}
    assert [(r["corpus"], r["router"]) for r in after["routers"]] == [
        ("canary", "topk"),
        ("text", "topk"),
        ("text", "expert_choice"),
    ]
