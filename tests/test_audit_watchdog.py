"""``moe-audit`` stops a forward that never returns to Python (fairseq's BASE layer loops forever
in C++ with the GIL held when the experts do not divide the tokens), which the SIGALRM time
limit cannot interrupt: the command's watchdog parent (moe.audit.watchdog) ends it at twice the
limit, one line on stderr, exit 2. The stand-in here blocks SIGALRM and sleeps on short
prefixes, as such a loop leaves the process: the signal never reaches Python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SUBPROCESS_ENV

STUCK = """
import signal
import time

import torch
from torch import nn


class Stuck(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[1] < 4:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(600)
        return self.lin(x)


class Leaks(nn.Module):
    def forward(self, x):
        return x + x.mean(1, keepdim=True)


class StuckLeaks(Stuck):  # reads the future, and sticks on a short prefix as Stuck does
    def forward(self, x):
        return super().forward(x) + x.mean(1, keepdim=True)


class StuckMixes(Stuck):  # mixes the samples of the batch (causal in time), and sticks
    def forward(self, x):
        return super().forward(x) + x.mean(0, keepdim=True)


stuck, leaks, stuck_leaks, stuck_mixes = Stuck, Leaks, StuckLeaks, StuckMixes
"""


def _audit(target: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "moe.audit", "--target", target, "--input", "float:2,8,8", "--no-progress", *flags],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=300,
    )
    return done, time.perf_counter() - start


def test_a_forward_stuck_where_the_alarm_cannot_reach_ends_the_command_at_twice_its_limit(tmp_path):
    (tmp_path / "targets.py").write_text(STUCK)
    done, seconds = _audit(f"{tmp_path / 'targets.py'}:stuck", "--forward-timeout", "1", "--modes", "eval")
    assert done.returncode == 2, done.stdout + done.stderr
    line = (
        "moe-audit: error: stuck: NOT AUDITED: a forward on an input of shape (2, 1, 8) did not return within 1 s "
        "(--forward-timeout), nor in the 1 s after: native code the time limit cannot interrupt; moe-audit stopped"
    )
    assert done.stderr.strip() == line
    assert seconds < 120  # not the 600 s the forward sleeps


@pytest.mark.parametrize(
    ("target", "code", "stop", "found"),
    [
        (  # a leak found before the stuck forward is the verdict: exit 1, not NOT AUDITED
            "stuck_leaks",
            1,
            "stuck_leaks: a forward",
            "LEAKS in eval mode (random_future, adversarial_future, jacobian); the rest not audited",
        ),
        (  # a batch coupling alone is said; no verdict on a leak: exit 2
            "stuck_mixes",
            2,
            "stuck_mixes: NOT AUDITED: a forward",
            "not batch-invariant in eval mode (batch_interference); no leak found yet, the rest not audited",
        ),
    ],
)
def test_a_stopped_audit_still_reports_what_it_found_before_the_stop(tmp_path, target, code, stop, found):
    (tmp_path / "targets.py").write_text(STUCK)
    done, _ = _audit(f"{tmp_path / 'targets.py'}:{target}", "--forward-timeout", "1", "--modes", "eval")
    assert done.returncode == code, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(f"moe-audit: error: {stop} on an input of shape (2, 1, 8) did not return within 1 s")
    assert lines[1:] == [f"moe-audit: {target}: found before the stop: {found}"]


def test_the_watched_command_exits_with_the_audits_own_code(tmp_path):
    (tmp_path / "targets.py").write_text(STUCK)
    done, _ = _audit(f"{tmp_path / 'targets.py'}:leaks", "--modes", "eval", "--quick")
    assert done.returncode == 1 and "LEAKS in eval mode" in done.stdout, done.stdout + done.stderr
    done, _ = _audit(f"{tmp_path / 'targets.py'}:missing")
    assert done.returncode == 2 and "moe-audit: error:" in done.stderr, done.stderr


def test_a_sigterm_to_the_command_ends_the_audit_too(tmp_path):
    """`timeout` signals the command, which is the watchdog parent: the audit it forked goes with it."""
    (tmp_path / "targets.py").write_text(STUCK)
    argv = [sys.executable, "-m", "moe.audit", "--target", f"{tmp_path / 'targets.py'}:stuck", "--input", "float:2,8,8"]
    proc = subprocess.Popen(
        [*argv, "--forward-timeout", "100", "--modes", "eval", "--no-progress"],
        env=SUBPROCESS_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 120
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.2)
    (child,) = map(int, children.read_text().split())
    time.sleep(3)  # into the stuck forward
    proc.terminate()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
