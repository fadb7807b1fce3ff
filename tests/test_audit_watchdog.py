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

from moe.audit import watchdog

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


# The watchdog's own parts, in this process (the parent) and a forked child that stands in for
# the audit: what it writes to the pipe, and how long it takes to be stopped.


def _watched(run) -> tuple[int, float]:
    """(the exit code supervised() gives, its seconds) for ``run`` in the forked child."""
    start = time.monotonic()
    code = watchdog.supervised(run)
    return code, time.monotonic() - start


def _stuck_after(*writes) -> callable:
    """A child that calls each of ``writes`` (the watchdog's own messages), then never returns."""

    def run():
        for write in writes:
            write()
        time.sleep(30)

    return run


@pytest.fixture
def parent_signals():
    """supervised() sets the parent's SIGINT, SIGTERM and SIGHUP handlers: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_stuck_forward_is_stopped_at_twice_its_limit_and_not_before(parent_signals, capsys):
    code, seconds = _watched(_stuck_after(lambda: watchdog.started(0.3, "t: a forward")))
    assert code == 2 and seconds >= 2 * 0.3, seconds  # the deadline is (1 + GRACE) x 0.3 s
    assert capsys.readouterr().err.startswith("moe-audit: error: t: a forward did not return within 0.3 s")


def test_a_forward_that_ended_sets_no_deadline(parent_signals):
    def run():
        watchdog.started(0.2, "t: a forward")
        watchdog.ended()
        time.sleep(0.8)  # past the forward's deadline, outside any forward
        return 0

    assert _watched(run)[0] == 0


def test_a_target_name_with_spaces_and_a_subject_with_a_newline_reach_the_stop_line(parent_signals, capsys):
    code, _ = _watched(
        _stuck_after(
            lambda: watchdog.found("my  target", "future", "train", "random_future"),
            lambda: watchdog.started(0.2, "my target: a forward\non (2, 1, 8)"),
        )
    )
    err = capsys.readouterr().err.splitlines()
    assert code == 1, err
    assert err[0].startswith("moe-audit: error: my target: a forward on (2, 1, 8) did not return within 0.2 s")
    assert err[1:] == [
        "moe-audit: my target: found before the stop: LEAKS in train mode (random_future); the rest not audited"
    ]


def test_a_line_split_over_two_reads_of_the_pipe_is_read_whole(parent_signals, capsys):
    def first_half():
        os.write(watchdog._channel, b"0.2 t: a for")
        time.sleep(0.3)  # the parent reads the half line alone

    code, _ = _watched(_stuck_after(first_half, lambda: os.write(watchdog._channel, b"ward\n")))
    assert code == 2 and "error: t: a forward did not return within 0.2 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raised", "code", "said"),
    [
        (None, 0, ""),  # run() returned None: as the interpreter, 0
        (SystemExit("moe-audit: error: bad"), 1, "moe-audit: error: bad\n"),  # a message: printed, 1
        (SystemExit(3), 3, ""),
        (KeyboardInterrupt(), 128 + signal.SIGINT, ""),  # 130, as a shell reports Ctrl-C
    ],
)
def test_the_child_exits_with_the_code_the_interpreter_would_give(monkeypatch, capsys, raised, code, said):
    monkeypatch.setattr(watchdog, "_channel", None)  # _child sets it: put it back

    def run():
        if raised is not None:
            raise raised

    assert watchdog._child(run, -1) == code
    assert capsys.readouterr().err == said


def test_the_stop_line_names_the_stuck_target_not_one_its_name_starts_with_and_leaks_first(capsys):
    findings = {
        "moe": {("future", "eval"): ["jacobian"]},  # another target, whose name begins the stuck one's
        "moe_big": {("decode", "eval"): ["decode_consistency"], ("future", "train"): ["random_future"]},
    }
    assert watchdog._stopped("moe_big: NOT AUDITED: a forward", 1.0, findings) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("moe-audit: error: moe_big: a forward did not return")
    assert err[1] == (
        "moe-audit: moe_big: found before the stop: LEAKS in train mode (random_future); "
        "not decode-consistent in eval mode (decode_consistency); the rest not audited"
    )
