"""The training loop under torchrun with --expert-parallel 2 reproduces the single-process run.

Same global batch, same seed: every step's loss and aux loss agree to 1e-4 relative (the
tolerance the issue asks for; measured: ~2e-7, fp32 rounding of a different summation
order), and the checkpoint the 2-process run writes is a single-process state dict whose
weights match the single-process run's final weights. torchrun --standalone picks a free
port; every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SOURCE_PATH, tiny_run_flags

from moe.training import config_from_args, train

ROOT = Path(__file__).resolve().parents[1]
COMMON = tiny_run_flags()
REL_TOL = 1e-4


def _torchrun(args: list[str], nproc: int, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    # A rank that aborts prints every thread's Python stack into the failure message: rank 1 of
    # the first test's finished run aborted at exit ("terminate called without an active
    # exception") in three fresh-clone suites, in the teardown that moe.training.cli.script now skips.
    env["PYTHONFAULTHANDLER"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "experiments" / "train.py"),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _compare(single: list[dict], parallel: list[dict]) -> None:
    assert [r["step"] for r in parallel] == [r["step"] for r in single] == list(range(1, 13))
    for key in ("loss", "aux_loss"):
        rel = [abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(single, parallel)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        assert rel[worst] <= REL_TOL, (
            f"{key} differs at step {worst + 1}: single {single[worst][key]:.7f} vs EP {parallel[worst][key]:.7f} "
            f"(rel {rel[worst]:.2e}; mean rel {sum(rel) / len(rel):.2e})"
        )
    for a, b in zip(single, parallel):
        assert a["tokens_per_expert"] == b["tokens_per_expert"], f"step {a['step']}: expert loads differ"
        assert len(b["expert_load"]) == len(a["expert_load"]) > 0


def _run_pair(tmp_path: Path, extra: list[str]) -> None:
    single = train(config_from_args([*COMMON, *extra]))
    jsonl, ckpt_dir = tmp_path / "ep.jsonl", tmp_path / "ckpt"
    _torchrun(
        [
            *COMMON,
            *extra,
            "--expert-parallel",
            "2",
            "--metrics-jsonl",
            str(jsonl),
            "--checkpoint-dir",
            str(ckpt_dir),
            "--export-model",
        ],
        2,
    )
    parallel = [json.loads(line) for line in jsonl.read_text().splitlines()]
    _compare(single.history, parallel)
    state = torch.load(ckpt_dir / "model.pt", map_location="cpu", weights_only=False)
    reference = single.model.state_dict()
    assert set(state["model"]) == set(reference)
    worst = max((state["model"][k] - v).abs().max().item() for k, v in reference.items())
    assert worst < 1e-4, f"EP checkpoint vs single-process final weights: max |diff| {worst:.2e}"


def test_expert_parallel_training_matches_single_process(tmp_path):
    _run_pair(tmp_path, [])


@pytest.mark.slow
def test_expert_parallel_training_matches_single_process_capacity(tmp_path):
    _run_pair(tmp_path, ["--router", "capacity", "--router-option", "capacity_factor=1.0"])


def test_expert_exchange_is_checked():
    with pytest.raises(ValueError, match="expert_exchange must be one of per_assignment, dedup, got 'once'"):
        config_from_args([*COMMON, "--expert-exchange", "once"])


@pytest.mark.slow
def test_bf16_gradient_reduce_is_applied(tmp_path):
    # FSDP2 reduce-scatters in bf16 (moe.parallel.reduce_precision): the losses move, a little,
    # and every step logs the bf16 reduction's distance from the fp32 one of the same gradients.
    runs = {}
    for dtype in ("fp32", "bf16"):
        jsonl = tmp_path / f"{dtype}.jsonl"
        _torchrun([*COMMON, "--grad-reduce-dtype", dtype, "--metrics-jsonl", str(jsonl)], 2)
        runs[dtype] = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rel = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(runs["fp32"], runs["bf16"])]
    assert len(rel) == 12 and 0 < max(rel) < 1e-2, rel
    assert all("grad_reduce_rel_diff" not in r for r in runs["fp32"])
    diffs = [r["grad_reduce_rel_diff"] for r in runs["bf16"]]
    # bf16 keeps 8 significant bits: each reduced element is off by up to 2^-9 relative (input
    # rounding plus one rounded sum), about 2^-10 in norm; fp32 would be ~1e-7.
    assert all(5e-4 < d < 5e-3 for d in diffs), diffs
    assert all(r["grad_reduce_max_abs_diff"] > 0 for r in runs["bf16"])


@pytest.mark.slow
def test_four_processes_two_expert_parallel_groups(tmp_path):
    # The command: 4 processes, P = 2 (two expert-parallel groups, experts FSDP2-sharded over 2).
    single = train(config_from_args(COMMON))
    jsonl = tmp_path / "ep2x2.jsonl"
    _torchrun([*COMMON, "--router", "topk", "--expert-parallel", "2", "--metrics-jsonl", str(jsonl)], 4)
    _compare(single.history, [json.loads(line) for line in jsonl.read_text().splitlines()])


def test_expert_parallel_must_divide_world_size():
    with pytest.raises(ValueError, match="must divide the number of processes"):
        train(config_from_args([*COMMON, "--expert-parallel", "2"]))


@pytest.mark.slow  # the lossy path of train() is also run by test_lossy_simulated (4 gloo processes)
def test_packet_loss_flags_train_over_the_lossy_transport(tmp_path):
    # --packet-loss replaces FSDP2 by replicated data parallelism over moe.parallel.lossy. The
    # reliable policy bypasses the loss: the single-process run. At p = 0.3 the metrics show 70%
    # of the network packets arriving, replicas that drift apart, and naive's shrunken steps
    # (expected bias -p(P-1)/P = -0.15 for P = 2 when the ranks' gradients agree; measured
    # about -0.2 over these 12 steps) against unbiased's (about 0).
    single = train(config_from_args(COMMON))
    runs = {}
    for policy in ("reliable", "unbiased", "naive"):
        jsonl = tmp_path / f"{policy}.jsonl"
        _torchrun(
            [
                *COMMON,
                "--packet-loss",
                "0.3",
                "--loss-policy",
                policy,
                "--loss-packet-size",
                "256",
                "--metrics-jsonl",
                str(jsonl),
            ],
            2,
        )
        runs[policy] = [json.loads(line) for line in jsonl.read_text().splitlines()]
    _compare(single.history, runs["reliable"])
    assert all(r["received_fraction"] == 1.0 and r["max_drift"] == 0.0 for r in runs["reliable"])

    def mean(policy: str, key: str) -> float:
        return sum(r[key] for r in runs[policy]) / len(runs[policy])

    for policy in ("unbiased", "naive"):
        assert abs(mean(policy, "received_fraction") - 0.7) < 0.03, mean(policy, "received_fraction")
        assert max(r["max_drift"] for r in runs[policy]) > 0
        assert all(0 < r["grad_rel_error"] for r in runs[policy])
    assert mean("naive", "grad_bias") < -0.05 and mean("naive", "grad_bias") < mean("unbiased", "grad_bias") - 0.05


def test_packet_loss_needs_more_than_one_process():
    with pytest.raises(ValueError, match="at least 2"):
        train(config_from_args([*COMMON, "--packet-loss", "0.1"]))
