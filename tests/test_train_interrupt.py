"""Ctrl-C during ``experiments/train.py``: one line saying the step reached, the last complete
checkpoint and the command that resumes from it (the same command plus --resume), exit 130,
no traceback. Ctrl-C is sent as a terminal sends it: SIGINT to the process
(``Popen.send_signal``), or to the whole process group of a ``torchrun`` launch."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, SUBPROCESS_ENV, TRAIN_SCRIPT

import moe.training.checkpoint_files as checkpoint_files
import moe.training.loop as loop
from moe.training import TrainConfig, train
from moe.training.cli import INTERRUPTED_EXIT, fail, interrupted_line
from moe.training.loop import Interrupted

TINY = [
    *("--preset", "tiny", "--steps", "100000", "--batch-size", "2", "--seq-len", "16", "--d-model", "32"),
    *("--moe-d-ff", "32", "--max-bytes", "20000", "--eval-every", "0", "--log-every", "0", "--no-progress"),
]
"""A run far too long to finish: only Ctrl-C ends it."""


def sigint_as_at_a_terminal() -> None:
    """A Popen ``preexec_fn``: the child starts with SIGINT at its default, as a command typed at a
    terminal does, whatever this process inherited (a background job, a ``nohup`` or an ``&`` in
    a script without job control, inherits SIG_IGN, and Python then leaves Ctrl-C ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(proc: subprocess.Popen, ready, send, timeout_s: float = 240) -> tuple[str, str]:
    """Wait until ``ready()`` (or the process ended), then ``send()`` Ctrl-C; the process's output."""
    deadline = time.monotonic() + timeout_s
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before Ctrl-C: {proc.communicate()[1][-3000:]}"
    send()
    return proc.communicate(timeout=120)


def complete(directory: Path, step: int) -> bool:
    return (directory / f"step-{step:08d}" / "COMPLETE").exists()


def _checkpointed_run(checkpoint_dir: Path) -> TrainConfig:
    """8 tiny steps with a checkpoint every 3."""
    return TrainConfig.flat(
        preset="tiny",
        steps=8,
        batch_size=2,
        seq_len=16,
        max_bytes=20_000,
        eval_every=0,
        log_every=0,
        progress=False,
        model={"d_model": 32, "moe_d_ff": 32},
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_every=3,
    )


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume_it_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    proc = subprocess.Popen(
        [sys.executable, TRAIN_SCRIPT, *args],
        env=SUBPROCESS_ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )
    _, err = interrupt_when(proc, lambda: complete(ckpt, 4), lambda: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1, err[-3000:]
    newest = sorted(p.name for p in ckpt.glob("step-*") if (p / "COMPLETE").exists())[-1]
    head, command = said[0].split("; resume from it: ")
    steps_done = int(head.split("interrupted after step ")[1].split(" of ")[0])
    assert head == f"interrupted after step {steps_done} of 100000; last complete checkpoint {ckpt / newest}", said[0]
    assert steps_done >= int(newest.removeprefix("step-")) >= 4, said[0]
    assert shlex.split(command) == [sys.executable, TRAIN_SCRIPT, *args, "--resume"], command


@pytest.mark.slow
def test_a_run_without_checkpoints_says_there_is_nothing_to_resume(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, TRAIN_SCRIPT, *TINY, "--metrics-jsonl", str(metrics)],
        env=SUBPROCESS_ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )

    def two_steps_logged() -> bool:
        return metrics.is_file() and metrics.read_text().count("\n") >= 2

    _, err = interrupt_when(proc, two_steps_logged, lambda: proc.send_signal(signal.SIGINT))
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    logged = metrics.read_text().count("\n")
    line = err.strip().splitlines()[-1]
    steps_done = int(line.split("interrupted after step ")[1].split(" of ")[0])
    # a step's record is written a moment before the step counts as done: Ctrl-C may fall between
    assert logged - 1 <= steps_done <= logged and steps_done >= 1, (logged, line)
    assert line.endswith("of 100000; no checkpoint to resume from (no --checkpoint-dir): the same command starts over")


def test_train_raises_a_keyboard_interrupt_that_says_how_far_it_got(tmp_path, monkeypatch):
    step = loop.train_step

    def interrupted_at_step_5(s, k):
        if k == 5:
            raise KeyboardInterrupt
        return step(s, k)

    monkeypatch.setattr(loop, "train_step", interrupted_at_step_5)
    cfg = _checkpointed_run(tmp_path)
    with pytest.raises(KeyboardInterrupt) as caught:
        train(cfg)
    stop = caught.value
    assert isinstance(stop, Interrupted)
    assert (stop.steps_done, stop.steps, stop.checkpoint) == (4, 8, tmp_path / "step-00000003")


def test_ctrl_c_during_a_checkpoint_save_waits_for_the_save(tmp_path, monkeypatch):
    """A SIGINT that arrives while DCP writes is held until the checkpoint is complete (DCP
    would wrap the KeyboardInterrupt in a CheckpointException: a traceback, exit 1)."""
    write = checkpoint_files.save_sharded
    sent = []

    def interrupted_while_writing(*args, **kwargs):
        if not sent:
            sent.append(os.getpid())
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered in the middle of the save
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "save_sharded", interrupted_while_writing)
    cfg = _checkpointed_run(tmp_path)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job inherits SIG_IGN
    try:
        with pytest.raises(Interrupted) as caught:
            train(cfg)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert sent and caught.value.checkpoint == tmp_path / "step-00000003"  # written whole, then stopped
    assert complete(tmp_path, 3) and not list(tmp_path.glob(".tmp-*"))


def test_the_line_of_a_run_with_a_checkpoint_dir_but_no_checkpoint_yet(tmp_path):
    line = interrupted_line(Interrupted(1, 50, tmp_path, None), ["--steps", "50"])
    assert (
        line
        == f"interrupted after step 1 of 50; no complete checkpoint in {tmp_path} yet: the same command starts over"
    )


@pytest.mark.slow
def test_ctrl_c_under_torchrun_rank_0_says_it_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    launcher = ["--standalone", "--nproc-per-node", "2"]
    args = [*TINY, "--batch-size", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, TRAIN_SCRIPT, *args],
        env=SUBPROCESS_ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C at a terminal reaches the launcher and every rank
    )
    _, err = interrupt_when(proc, lambda: complete(ckpt, 4), lambda: os.killpg(proc.pid, signal.SIGINT))
    said = [line for line in err.splitlines() if line.startswith("interrupted after step")]
    assert len(said) == 1, err[-3000:]  # rank 0 alone; torchrun then reports the signal in its own words
    command = said[0].split("; resume from it: ")[1]
    assert shlex.split(command) == ["torchrun", *launcher, TRAIN_SCRIPT, *args, "--resume"], command


def test_the_line_reaches_stderr_in_one_write(monkeypatch):
    """torchrun's ranks share its stderr pipe: a line written in two parts (print's separate
    newline) lets the launcher's own log line land inside it, so the resume command is torn."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    with pytest.raises(SystemExit):
        fail("interrupted after step 4 of 8", INTERRUPTED_EXIT, prefix="")
    assert writes == ["interrupted after step 4 of 8\n"]
