"""Nothing a user has on disk is lost, nothing untrustworthy is kept (issue 60): a fresh run
refuses a folder holding another run's checkpoints, a resume refuses another run naming the
fields that differ, a diverged run stops in one line without writing over or rotating away a
good checkpoint, and a full or read-only disk is one line with the partial checkpoint removed.
Each test takes a snapshot of every file before the run and compares it, byte for byte, after."""

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import moe.training.checkpoint_files as cf
import moe.training.guards as guards
from moe.training import main
from moe.training.checkpoint_files import META, complete_checkpoints

RUN = [
    "--seq-len", "32", "--batch-size", "8", "--max-bytes", "200000", "--eval-windows", "4",
    "--eval-batch-size", "4", "--causal-stride", "8", "--warmup-steps", "2", "--log-every", "0",
    "--no-progress", "--d-model", "32", "--moe-d-ff", "64", "--eval-every", "0",
]  # fmt: skip


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run(*args: str) -> int:
    """``experiments/train.py`` with ``args`` in this process: its exit status."""
    try:
        main([*RUN, *args])
    except SystemExit as e:
        return int(e.code)
    return 0


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A 4-step run's folder: checkpoints step-2 and step-4 (every 2, the last 2 kept) and metrics."""
    d = tmp_path_factory.mktemp("run")
    assert run("--steps", "4", "--checkpoint-dir", str(d), "--checkpoint-every", "2", "--metrics-jsonl", str(d / "m.jsonl")) == 0  # fmt: skip
    assert [p.name for p in complete_checkpoints(d)] == ["step-00000002", "step-00000004"]
    return d


@pytest.fixture
def folder(four_steps, tmp_path) -> Path:
    """A copy of :func:`four_steps`'s folder, to be run into."""
    subprocess.run(["cp", "-a", str(four_steps), str(tmp_path / "run")], check=True)
    return tmp_path / "run"


@pytest.mark.parametrize("other", [["--seed", "1"], ["--d-model", "64"], []])
def test_a_fresh_run_into_another_runs_folder_is_refused_and_changes_nothing(folder, capsys, other):
    before = snapshot(folder)
    capsys.readouterr()
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--checkpoint-every", "2", *other) == 2
    line = one_error_line(capsys)
    assert str(folder) in line and "--resume" in line and "another --checkpoint-dir" in line, line
    assert snapshot(folder) == before


def test_a_resume_of_another_run_names_the_fields_that_differ_and_changes_nothing(folder, capsys):
    before = snapshot(folder)
    capsys.readouterr()
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", "--seed", "1", "--d-model", "64") == 2
    line = one_error_line(capsys)
    assert "--seed 0 there, 1 here" in line and "--d-model 32 there, 64 here" in line, line
    assert "n_layers" not in line and len(line) < 300, line  # the fields that differ, not the whole config
    assert snapshot(folder) == before


def test_a_changed_learning_rate_on_resume_is_said_and_used(folder, capsys):
    result = main([*RUN, "--log-every", "1", "--steps", "5", "--checkpoint-dir", str(folder), "--resume", "--lr", "0.001", "--beta2", "0.99"])  # fmt: skip
    out = capsys.readouterr().out
    assert "changed on resume: --lr 0.001 (was 0.003), --beta2 0.99 (was 0.95)" in out, out
    assert all(g["betas"] == (0.9, 0.99) for g in result.optimizer.param_groups)  # the flag's, not the checkpoint's


@pytest.mark.parametrize("lr, status", [("inf", 2), ("1e30", 1), ("3e38", 1)])
def test_divergence_on_resume_stops_in_one_line_and_keeps_every_checkpoint(folder, capsys, lr, status):
    """--lr inf is refused; 1e30 makes finite weights whose next step is NaN (the checkpoint
    written between is removed, the older ones never rotated away); 3e38 overflows AdamW's step."""
    before = snapshot(folder)
    jsonl = folder / "m.jsonl"
    capsys.readouterr()
    code = run("--steps", "8", "--checkpoint-dir", str(folder), "--resume", "--lr", lr, "--checkpoint-every", "1", "--keep-checkpoints", "2", "--metrics-jsonl", str(jsonl))  # fmt: skip
    assert code == status
    line = one_error_line(capsys)
    if status == 1:
        assert line.startswith("error: step ") and "diverged" in line and "step-00000004" in line, line
    after, records = snapshot(folder), ("m.jsonl", "m.config.json")
    assert {k: v for k, v in after.items() if k not in records} == {k: v for k, v in before.items() if k not in records}
    assert after["m.jsonl"].startswith(before["m.jsonl"])  # the records of the steps taken are appended
    invocations = [json.loads(after[k])["invocations"] for k in ("m.config.json",)][0]
    assert invocations[0] == json.loads(before["m.config.json"])["invocations"][0]  # and this invocation's config


@pytest.mark.parametrize("lr, status", [("inf", 2), ("1e30", 1)])
def test_divergence_from_scratch_leaves_no_checkpoint_of_it(tmp_path, capsys, lr, status):
    (tmp_path / "notes.txt").write_text("the user's own file")
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert run("--steps", "6", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1", "--lr", lr) == status
    line = one_error_line(capsys)
    assert status == 2 or (line.startswith("error: step 2: ") and "no checkpoint of it is kept" in line), line
    assert snapshot(tmp_path) == before  # step 1's checkpoint, which step 2 diverged from, was removed


def test_a_checkpoint_of_non_finite_weights_is_not_written(folder, capsys, monkeypatch):
    before = snapshot(folder)
    monkeypatch.setattr("moe.training.loop.weights_finite", lambda model: False)
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "1") == 1
    assert "step 5: the weights are not finite after the update" in one_error_line(capsys)
    assert snapshot(folder) == before


def test_a_loss_worse_than_a_uniform_guess_warns_once_and_rotates_nothing_away(folder, capsys, monkeypatch):
    monkeypatch.setattr("moe.training.loop.worse_than_uniform", lambda loss, vocab_size: True)
    before = snapshot(folder)
    capsys.readouterr()
    assert run("--steps", "7", "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "1", "--keep-checkpoints", "1") == 0  # fmt: skip
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 5: the training loss"), warnings
    assert snapshot(folder).items() >= before.items()  # nothing older rotated away
    assert len(complete_checkpoints(folder)) == 5


def test_a_full_disk_is_one_line_the_partial_checkpoint_removed_and_resume_works(folder, capsys, monkeypatch):
    before = snapshot(folder)
    real = cf.save_sharded

    def disk_fills(path, model, optimizer):
        (path / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cf, "save_sharded", disk_fills)
    capsys.readouterr()
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "1") == 1
    line = one_error_line(capsys)
    assert "could not write checkpoint step-00000005" in line and "no space left on device" in line, line
    assert "the last complete one is step-00000004" in line, line
    assert snapshot(folder) == before and not list(folder.glob(".tmp-*"))
    # torch's zip writer reports a short write as "unexpected pos": read as a full disk when it is
    monkeypatch.setattr(cf, "save_sharded", lambda *a: (_ for _ in ()).throw(RuntimeError("unexpected pos 704 vs 598")))
    calls = []  # the check before the first step sees room; the failed write a full disk

    def disk_usage(path):
        calls.append(path)
        return type("usage", (), {"free": 2**40 if len(calls) == 1 else 1024})()

    monkeypatch.setattr(guards.shutil, "disk_usage", disk_usage)
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "1") == 1
    assert "no space left on device" in one_error_line(capsys)
    assert snapshot(folder) == before
    monkeypatch.setattr(cf, "save_sharded", real)
    monkeypatch.undo()
    (folder / ".tmp-step-00000006").mkdir()  # a leftover of a killed save does not break the resume
    (folder / ".tmp-step-00000006" / "junk").write_bytes(b"x")
    assert run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", "--checkpoint-every", "1") == 0
    assert [p.name for p in complete_checkpoints(folder)] == ["step-00000005", "step-00000006"]
    assert not list(folder.glob(".tmp-*"))


def test_an_export_that_meets_a_full_disk_is_one_line_and_a_resume_exports(tmp_path, capsys, monkeypatch):
    real = torch.save

    def full_for_the_export(obj, f, *args, **kwargs):
        if ".model.pt.tmp" in str(f):
            Path(f).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_for_the_export)
    capsys.readouterr()
    assert run("--steps", "2", "--checkpoint-dir", str(tmp_path), "--export-model") == 1
    line = one_error_line(capsys)
    assert f"could not write {tmp_path / 'model.pt'}: no space left on device" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # no partial file left
    monkeypatch.undo()
    assert run("--steps", "2", "--checkpoint-dir", str(tmp_path), "--export-model", "--resume") == 0
    assert (tmp_path / "model.pt").is_file()


@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_a_read_only_folder_is_refused_before_the_first_step(folder, tmp_path, capsys, monkeypatch, where):
    """Simulated (root writes through chmod): the probe file meets EROFS."""
    before = snapshot(folder)

    def read_only(dir, prefix):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(guards.tempfile, "mkstemp", read_only)
    args = ["--checkpoint-dir", str(folder), "--resume"] if where == "checkpoint" else ["--metrics-jsonl", str(folder / "new.jsonl")]  # fmt: skip
    capsys.readouterr()
    assert run("--steps", "6", *args) == 2
    line = one_error_line(capsys)
    assert "is not writable (Read-only file system)" in line, line
    assert snapshot(folder) == before


@pytest.fixture
def tmpfs(tmp_path):
    """A mount point for a real tmpfs (skipped where this process may not mount)."""
    point = tmp_path / "mnt"
    point.mkdir()
    mounted = []

    def mount(options: str) -> Path:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(point)
        return point

    yield mount
    for p in mounted:
        subprocess.run(["umount", str(p)], check=False)


def test_a_real_small_or_read_only_disk_is_refused_before_the_first_step(tmpfs, capsys):
    small = tmpfs("size=300k")
    assert run("--steps", "2", "--checkpoint-dir", str(small / "run")) == 2
    line = one_error_line(capsys)
    assert "MiB free, one checkpoint of this run needs at least" in line, line
    subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
    assert run("--steps", "2", "--metrics-jsonl", str(small / "m.jsonl")) == 2
    assert "Read-only file system" in one_error_line(capsys)


def test_a_real_disk_that_fills_says_so_and_keeps_the_last_checkpoint(tmpfs, capsys):
    disk = tmpfs("size=1400k")
    assert run("--steps", "4", "--checkpoint-dir", str(disk / "run"), "--checkpoint-every", "2", "--keep-checkpoints", "3") == 1  # fmt: skip
    line = one_error_line(capsys)
    assert "no space left on device" in line and "the last complete one is step-00000002" in line, line
    assert not list((disk / "run").glob(".tmp-*"))
    assert json.loads((disk / "run" / "step-00000002" / META).read_text())["step"] == 2


def _two_process_worker(rank: int, world: int, args: list[str], read_only_on_rank0: bool) -> str:
    """``experiments/train.py``'s config of ``args`` trained on this rank: the error's class name, or "ok"."""
    from moe.training import config_from_args, train

    if read_only_on_rank0 and rank == 0:
        guards.tempfile.mkstemp = lambda **kw: (_ for _ in ()).throw(OSError(errno.EROFS, os.strerror(errno.EROFS)))
    try:
        train(config_from_args([*RUN, *args]))
    except Exception as e:  # what each rank saw
        return type(e).__name__
    return "ok"


@pytest.mark.slow
def test_two_processes_stop_together_and_change_nothing(folder):
    """Each refusal reaches every rank (no rank left waiting in a collective): another run's
    folder, a divergence, and a folder only rank 0 checks (read-only there)."""
    from moe.parallel.launch import ok_values, run_local

    before = snapshot(folder)
    cases = [
        (["--steps", "6", "--checkpoint-dir", str(folder)], False, "SetupError"),
        (
            ["--steps", "8", "--checkpoint-dir", str(folder), "--resume", "--lr", "1e30", "--checkpoint-every", "1"],
            False,
            "Diverged",
        ),  # fmt: skip
        (["--steps", "6", "--checkpoint-dir", str(folder), "--resume"], True, "SetupError"),
    ]
    for args, read_only, error in cases:
        assert ok_values(run_local(_two_process_worker, 2, args, read_only, timeout_s=240)) == [error, error], args
        assert snapshot(folder) == before, args
