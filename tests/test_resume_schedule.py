"""A resumed run keeps the learning-rate schedule it started with when ``--steps`` grows, here
through the command line and for a run that itself started with ``--schedule-steps`` longer
than its ``--steps`` (it stopped inside its schedule): the schedule in force is the started
run's schedule length, not its ``--steps`` and not the new ``--steps``. The rates are checked
against the documented schedule written out by hand (cosine from lr to lr * min_lr_ratio over
the schedule's steps, no warmup at 8 steps: min(30, 8 // 10) = 0; the final rate after it)."""

from __future__ import annotations

import json
import math

import pytest

from moe.training.cli import main

LR, MIN_RATIO, SCHEDULE = 1e-2, 0.1, 8
RUN = [
    *("--seq-len", "16", "--batch-size", "2", "--max-bytes", "20000", "--eval-windows", "2"),
    *("--eval-batch-size", "2", "--causal-stride", "8", "--d-model", "32", "--moe-d-ff", "32"),
    *("--lr", str(LR), "--min-lr-ratio", str(MIN_RATIO), "--eval-every", "0"),
    *("--no-progress", "--wandb-mode", "disabled", "--log-every", "1"),
]


def hand_rate(step: int) -> float:
    """The rate of (1-based) ``step`` of the 8-step schedule, then its final rate."""
    progress = min((step - 1) / (SCHEDULE - 1), 1.0)
    return LR * MIN_RATIO + LR * (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def rates(path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, path.read_text().splitlines()) if "lr" in r}


def test_a_run_started_inside_a_longer_schedule_keeps_it_when_resumed_with_more_steps(tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path / "run"), "--checkpoint-every", "4"]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    main([*RUN, *ckpt, "--steps", "4", "--schedule-steps", str(SCHEDULE), "--metrics-jsonl", str(first)])
    main([*RUN, *ckpt, "--steps", "12", "--resume", "--metrics-jsonl", str(second)])
    got = {**rates(first), **rates(second)}
    assert sorted(got) == list(range(1, 13)), sorted(got)
    want = {step: hand_rate(step) for step in range(1, 13)}
    assert [got[s] for s in want] == pytest.approx(list(want.values()), rel=1e-12), (got, want)
    assert got[5] > got[6] > got[7] > got[8] == got[12] == pytest.approx(LR * MIN_RATIO)  # decaying after the resume
