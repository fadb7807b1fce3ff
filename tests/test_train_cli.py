"""The trainer answers like a tool: one-line errors with exit status 2, "did you mean" for a
mistyped flag, what a resume did, where wandb wrote, a warmup that fits short runs."""

import pytest

from moe.eval import format_difference
from moe.training import TrainConfig, lr_at
from moe.training.cli import main
from moe.training.optim import OptimizerConfig
from moe.training.report import log_line

RUN = [
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--max-bytes",
    "20000",
    "--eval-windows",
    "2",
    "--eval-batch-size",
    "2",
    "--causal-stride",
    "8",
    "--d-model",
    "32",
    "--moe-d-ff",
    "32",
    "--no-progress",
    "--wandb-mode",
    "disabled",
    "--log-every",
    "1",
]


def refused(argv, capsys) -> str:
    """The one line ``main(argv)`` prints before exiting 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2, exit_info.value.code
    err = capsys.readouterr().err.strip()
    return err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "no/such/corpus"], "--data 'no/such/corpus': no such file or directory"),
        (["--batch-size", "0"], "batch_size must be a positive integer, got 0"),
        (["--router", "nope"], "unknown router 'nope'; known routers:"),
        (["--preset", "huge"], "unknown preset 'huge'; known presets: tiny"),
        (["--lr", "-1"], "lr must be finite and > 0, got -1.0"),
        (["--lr", "inf"], "lr must be finite and > 0, got inf"),
        (["--min-lr-ratio", "2"], "min_lr_ratio must be in [0, 1], got 2.0"),
        (["--beta2", "1"], "beta2 must be in [0, 1), got 1.0"),
        (["--steps", "-5"], "steps must be a positive integer, got -5"),
        (["--router-option", "top_k=8"], "top_k must be an integer in [1, num_experts=4], got 8"),
        (["--seq-len", "512"], "seq_len=512 exceeds the tiny preset's max_seq_len=128"),
        # a value that does not convert names its flag
        (["--steps", "fifty"], "--steps: invalid literal for int() with base 10: 'fifty'"),
        (["--lr", "fast"], "--lr: could not convert string to float: 'fast'"),
        (["--warmup-steps", "x"], "--warmup-steps: no type matching"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, message, capsys):
    err = refused(args, capsys)
    assert err.count("\n") == 0 and err.startswith("error: ") and message in err, err


def test_a_corpus_shorter_than_one_window_is_refused(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("just a few bytes of text, " * 2)
    err = refused([*RUN, "--steps", "1", "--data", str(tmp_path / "tiny.txt")], capsys)
    assert err.count("\n") == 0 and "fewer than one window of seq_len + 1 = 17" in err, err


def test_a_mistyped_flag_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--stpes", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--stpes" in err and "Perhaps you meant" in err and "--steps" in err, err


def test_resume_says_what_it_did(tmp_path, capsys):
    ckpt = ["--checkpoint-dir", str(tmp_path / "run"), "--resume"]
    main([*RUN, "--steps", "2", *ckpt])
    out = capsys.readouterr().out
    assert f"no checkpoint found in {tmp_path / 'run'}, starting fresh" in out, out
    main([*RUN, "--steps", "3", *ckpt])
    assert "resumed from step-00000002 (1 steps to go)" in capsys.readouterr().out
    err = refused([*RUN, "--steps", "2", *ckpt], capsys)
    assert "the last checkpoint, step-00000003, is past --steps 2" in err, err


def test_wandb_offline_runs_go_to_the_runs_own_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main([*RUN, "--steps", "1", "--wandb-mode", "offline", "--metrics-jsonl", str(tmp_path / "run" / "m.jsonl")])
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and not (tmp_path / "wandb").exists(), list(tmp_path.rglob("*"))
    assert f"wandb: offline run written to {runs[0]}" in capsys.readouterr().out


def test_warmup_fits_short_runs():
    assert OptimizerConfig(steps=300).warmup == 30 and OptimizerConfig(steps=12).warmup == 1
    assert OptimizerConfig(steps=12, warmup_steps=5).warmup == 5
    short = TrainConfig.flat(steps=12, lr=1.0, min_lr_ratio=0.1).optimizer
    lrs = [lr_at(s, short) for s in range(12)]
    assert lrs[0] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1), lrs  # warmed up, then decayed to the end


def test_a_gap_that_rounds_to_zero_is_printed_without_a_sign():
    got = [format_difference(v) for v in (-4e-5, 4e-5, 0.0, -0.0, 0.01234, -0.02)]
    assert got == ["0.0000", "0.0000", "0.0000", "0.0000", "+0.0123", "-0.0200"]
    assert format_difference(-4e-3, 2, plus=False) == "0.00" and format_difference(-0.5, 2, plus=False) == "-0.50"
    record = dict(
        step=3, loss=2.0, aux_loss=0.01, lr=1e-3, dropped_fraction=0.0, tokens_per_s=100.0, peak_memory_mib=1.0
    )
    record.update({"eval/teacher_forced_loss": 2.07944, "eval/causal_loss": 2.07943, "eval/leakage_gap": -1e-5})
    assert log_line(record).endswith("eval tf 2.0794 causal 2.0794 gap 0.0000"), log_line(record)


class _Exited(Exception):
    pass


@pytest.mark.parametrize("world_size, exits", [(None, False), ("1", False), ("2", True)])
def test_a_finished_torchrun_worker_leaves_without_the_interpreters_teardown(monkeypatch, world_size, exits):
    """``experiments/train.py``'s entry exits at once with status 0 after a finished run in a
    torchrun worker (torch keeps gloo threads alive past destroy_process_group; their teardown
    aborted finished ranks), and returns normally in a single process."""
    import moe.training.cli as cli

    ran, exit_codes = [], []

    def fake_exit(code):
        exit_codes.append(code)
        raise _Exited

    monkeypatch.setattr(cli, "main", lambda: ran.append(True))
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    if exits:
        with pytest.raises(_Exited):
            cli.script()
    else:
        cli.script()
    assert ran == [True] and exit_codes == ([0] if exits else [])


def test_a_failed_torchrun_worker_exits_with_its_status_not_zero(monkeypatch):
    """A run that fails (here a user error: exit 2) never reaches the immediate exit 0."""
    import moe.training.cli as cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli.os, "_exit", lambda code: pytest.fail(f"os._exit({code}) after a failed run"))
    monkeypatch.setattr(cli.sys, "argv", ["train.py", "--steps", "0"])
    with pytest.raises(SystemExit) as info:
        cli.script()
    assert info.value.code == 2
