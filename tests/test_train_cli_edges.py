"""The trainer's command line at its edges, without running a model: ``--config`` as the last
word or with ``=`` in its path, and the one line an interrupted run prints (its resume command
written out by hand)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moe.training.cli as cli
from moe.training.cli import interrupted_line, split_config_flag
from moe.training.guards import RunStopped
from moe.training.loop import Interrupted, SetupError


def test_config_flag_forms():
    assert split_config_flag(["--steps", "3", "--config", "a.toml", "--lr", "1"]) == (
        "a.toml",
        ["--steps", "3", "--lr", "1"],
    )
    assert split_config_flag(["--config=runs/lr=3e-3.toml", "--steps", "3"]) == ("runs/lr=3e-3.toml", ["--steps", "3"])
    assert split_config_flag(["--steps", "3"]) == (None, ["--steps", "3"])


def test_config_as_the_last_word_needs_a_path():
    with pytest.raises(ValueError, match="--config needs a file path"):
        split_config_flag(["--steps", "3", "--config"])


@pytest.fixture
def command_line(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def set_args(args: list[str]) -> list[str]:
        monkeypatch.setattr(sys, "argv", ["train.py", *args])
        monkeypatch.setattr(sys, "orig_argv", ["python", "-u", "train.py", *args])
        return args

    return set_args


@pytest.mark.parametrize("resumed", [False, True])
def test_the_resume_command_adds_resume_once(command_line, resumed):
    args = command_line(["--steps", "9", "--checkpoint-dir", "ck", *(["--resume"] if resumed else [])])
    stop = Interrupted(3, 9, Path("ck"), Path("ck/step-00000003"))
    assert interrupted_line(stop, args) == (
        "interrupted after step 3 of 9; last complete checkpoint ck/step-00000003; "
        "resume from it: python -u train.py --steps 9 --checkpoint-dir ck --resume"
    )


def test_the_line_without_a_checkpoint(command_line):
    args = command_line(["--steps", "9"])
    assert interrupted_line(Interrupted(2, 9, None, None), args) == (
        "interrupted after step 2 of 9; no checkpoint to resume from (no --checkpoint-dir): the same command starts over"
    )
    assert interrupted_line(Interrupted(2, 9, Path("ck"), None), args) == (
        "interrupted after step 2 of 9; no complete checkpoint in ck yet: the same command starts over"
    )


@pytest.fixture
def torchrun_parent(monkeypatch):
    """This process's parent stands in for a torchrun launcher (a sleeping process whose command
    line is ``/usr/bin/torchrun --standalone --nproc-per-node 2 train.py --steps 9``)."""
    words = ["/usr/bin/torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--steps", "9"]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while words[0].encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)  # just after the fork the child's command line may still read empty
    monkeypatch.setattr(os, "getppid", lambda: proc.pid)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "9"])
    yield
    proc.kill()
    proc.wait()


def test_under_torchrun_the_resume_command_is_the_launchers_own(torchrun_parent):
    """The launcher's options (between its name, a path here, and the script) come before the
    script part; the launcher's name once."""
    stop = Interrupted(3, 9, Path("ck"), Path("ck/step-00000003"))
    assert interrupted_line(stop, ["--steps", "9"]) == (
        "interrupted after step 3 of 9; last complete checkpoint ck/step-00000003; resume from it: "
        "torchrun --standalone --nproc-per-node 2 train.py --steps 9 --resume"
    )


def test_a_launcher_that_did_not_start_this_script_gives_no_options(torchrun_parent, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["other.py", "--steps", "9"])
    assert cli.torchrun_options() is None
    stop = Interrupted(3, 9, Path("ck"), Path("ck/step-00000003"))
    assert interrupted_line(stop, ["--steps", "9"]).endswith(
        "resume from it: your torchrun command with the script part other.py --steps 9 --resume"
    )


@pytest.mark.parametrize(("rank", "local_rank", "said"), [("0", "0", True), ("1", "0", False), ("2", "1", False)])
def test_only_global_rank_0_says_the_failure(monkeypatch, capsys, rank, local_rank, said):
    """The second node's first worker has LOCAL_RANK 0 but RANK 1: it stays silent."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(SystemExit) as info:
        cli.fail(ValueError("bad"))
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: bad\n" if said else "")


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (SetupError("no corpus"), 2, "error: no corpus"),
        (RunStopped("the loss is NaN"), 1, "error: the loss is NaN"),  # stopped after it started: 1, not 2
        (KeyboardInterrupt(), 130, "interrupted before the first step"),
    ],
)
def test_main_exits_with_the_status_of_what_stopped_the_run(monkeypatch, capsys, raised, code, line):
    def train(cfg):
        raise raised

    monkeypatch.setattr(cli, "train", train)
    monkeypatch.delenv("RANK", raising=False)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["--steps", "1"])
    finally:
        signal.signal(signal.SIGINT, previous)  # main() installs its Ctrl-C handler
    assert info.value.code == code
    assert capsys.readouterr().err == line + "\n"
