"""Two nodes on one machine: two ``torchrun`` launchers (``--nnodes 2 --node-rank 0|1``, c10d
rendezvous on 127.0.0.1) of 2 processes each train the tiny preset with expert parallelism
inside a node (``--expert-parallel 2``: the ``ep`` mesh dim is the innermost, so an
expert-parallel group is the two local ranks of one node) and data parallelism across the
nodes (``--dp-replicate 2``: HSDP, replicas on different nodes), and give the single-process
losses and gradient norms (1e-4 relative, as tests/test_fsdp.py: fp32 sums in another order).
The commands are those of docs/scaling.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SUBPROCESS_ENV, TRAIN_SCRIPT, free_port, tiny_run_flags

from moe.training import config_from_args, train

COMMON = tiny_run_flags(8)
REL_TOL = 1e-4


@pytest.mark.slow
def test_two_torchrun_nodes_ep_inside_hsdp_across_equal_one_process(tmp_path):
    single = train(config_from_args(COMMON)).history
    port, jsonl = free_port(), tmp_path / "metrics.jsonl"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-nodes",
                TRAIN_SCRIPT,
                *COMMON,
                "--expert-parallel",
                "2",
                "--dp-replicate",
                "2",
                "--metrics-jsonl",
                str(jsonl),
            ],
            env=SUBPROCESS_ENV,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    for proc in nodes:
        try:
            logs.append(proc.communicate(timeout=600)[0])
        finally:
            proc.kill()
    for node, (proc, log) in enumerate(zip(nodes, logs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{log[-3000:]}"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for a, b in zip(single, records):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(a[key]), f"step {a['step']} {key}: {b[key]} vs {a[key]}"
