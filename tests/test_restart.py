"""Restarts under ``torchrun --max-restarts``: rank 1 dies at step 7 of 12 on the first attempt
(``MOE_FAULT_AT_STEP``), torchrun restarts the job, it resumes from the last complete sharded
checkpoint (step 6) and the 12 per-step losses equal an uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SOURCE_PATH, tiny_run_flags

from moe.training import config_from_args, train

ROOT = Path(__file__).resolve().parents[1]
COMMON = tiny_run_flags()
REL_TOL = 1e-4


@pytest.mark.slow
def test_rank_killed_at_step_7_restarts_and_matches(tmp_path):
    single = train(config_from_args(COMMON)).history
    jsonl = tmp_path / "metrics.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": SOURCE_PATH,
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "MOE_FAULT_AT_STEP": "7",
        "MOE_FAULT_RANK": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        str(ROOT / "experiments" / "train.py"),
        *COMMON,
        "--expert-parallel",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "3",
        "--resume",
        "--metrics-jsonl",
        str(jsonl),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "exitcode: 17" in proc.stderr or "exit code 17" in proc.stderr.lower(), f"the fault never fired:\n{log}"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for a, b in zip(single, records):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(a[key]), f"step {a['step']} {key}: {b[key]} vs {a[key]}"
