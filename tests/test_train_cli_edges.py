"""The trainer's command line at its edges, without running a model: ``--config`` as the last
word or with ``=`` in its path, and the one line an interrupted run prints (its resume command
written out by hand)."""

import sys
from pathlib import Path

import pytest

from moe.training.cli import interrupted_line, split_config_flag
from moe.training.loop import Interrupted


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
