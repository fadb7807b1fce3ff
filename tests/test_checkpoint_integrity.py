"""Checkpoints that survive damage: checksums in meta.json, verified on resume; a damaged or
truncated newest checkpoint falls back (one warning line) to the newest one that verifies,
and the run then equals an uninterrupted one; rotation never deletes the last one that verifies."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_RUN

from moe.training import TrainConfig, train
from moe.training.checkpoint_files import (
    COMPLETE,
    META,
    checkpoint_path,
    complete_checkpoints,
    file_checksums,
    rotation_victims,
    verify_checkpoint,
)

SMALL = {**SMALL_RUN, "eval_every": 0}


def shard(ckpt: Path) -> Path:
    (f,) = ckpt.glob("*.distcp")  # one process writes one shard file
    return f


def flip_bytes(f: Path, at: int = 100, n: int = 8) -> None:
    data = bytearray(f.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    f.write_bytes(bytes(data))


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def six_steps(ckpt: Path, jsonl: Path, resume: bool = False) -> TrainConfig:
    """6 steps with checkpoints at steps 2, 4 and 6 in ``ckpt`` (all kept), losses to ``jsonl``."""
    return TrainConfig.flat(
        steps=6,
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        keep_checkpoints=3,
        resume=resume,
        metrics_jsonl=str(jsonl),
        **SMALL,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4 and 6 (kept) and its per-step losses."""
    d = tmp_path_factory.mktemp("run")
    train(six_steps(d / "ckpt", d / "full.jsonl"))
    return d


def copy_run(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_meta_records_every_file_and_an_intact_checkpoint_verifies(run):
    ckpt = checkpoint_path(run / "ckpt", 6)
    recorded = json.loads((ckpt / META).read_text())["checksums"]
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name not in (META, COMPLETE))
    assert sorted(recorded) == on_disk
    assert all(verify_checkpoint(p) is None for p in complete_checkpoints(run / "ckpt"))


@pytest.mark.parametrize("damage,fallback", [(flip_bytes, 4), (truncate, 4)])
def test_damaged_newest_checkpoint_falls_back_with_one_warning(run, tmp_path, capsys, damage, fallback):
    ckpt = copy_run(run, tmp_path)
    damage(shard(checkpoint_path(ckpt, 6)))
    assert verify_checkpoint(checkpoint_path(ckpt, 6)) is not None
    jsonl = tmp_path / "resumed.jsonl"
    capsys.readouterr()
    train(six_steps(ckpt, jsonl, resume=True))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step-00000006" in warnings[0], warnings
    want, got = losses(run / "full.jsonl"), losses(jsonl)
    assert sorted(got) == list(range(fallback + 1, 7)), f"resumed from the wrong step: {sorted(got)}"
    for step, loss in got.items():
        assert loss == want[step], (step, loss, want[step])
    assert verify_checkpoint(checkpoint_path(ckpt, 6)) is None  # the rerun rewrote step 6


def test_two_damaged_checkpoints_fall_back_two_and_none_left_is_an_error(run, tmp_path):
    ckpt = copy_run(run, tmp_path)
    truncate(shard(checkpoint_path(ckpt, 6)))
    flip_bytes(shard(checkpoint_path(ckpt, 4)), at=2000)
    jsonl = tmp_path / "resumed.jsonl"
    train(six_steps(ckpt, jsonl, resume=True))
    assert sorted(losses(jsonl)) == [3, 4, 5, 6]
    for step in (2, 4, 6):
        truncate(shard(checkpoint_path(ckpt, step)))
    with pytest.raises(ValueError, match="no checkpoint in .* verifies"):
        train(TrainConfig.flat(steps=6, checkpoint_dir=str(ckpt), resume=True, **SMALL))


def fake_checkpoint(root: Path, step: int) -> Path:
    p = checkpoint_path(root, step)
    p.mkdir(parents=True)
    (p / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (p / META).write_text(json.dumps({"step": step, "checksums": file_checksums(p)}))
    (p / COMPLETE).write_text("")
    return p


def test_rotation_spares_the_newest_verifying_checkpoint(tmp_path):
    ckpts = [fake_checkpoint(tmp_path, s) for s in (1, 2, 3, 4)]
    assert rotation_victims(ckpts, 2) == ckpts[:2]
    flip_bytes(ckpts[3] / "__0_0.distcp")
    assert rotation_victims(ckpts, 2) == ckpts[:2], "one of the kept two still verifies"
    truncate(ckpts[2] / "__0_0.distcp")
    assert rotation_victims(ckpts, 2) == [ckpts[0]], "step 2 is the newest that verifies: kept"
    assert rotation_victims(ckpts, 1) == [ckpts[0], ckpts[2]]


def test_checkpoint_without_checksums_is_accepted_and_unreadable_meta_is_not(tmp_path):
    p = fake_checkpoint(tmp_path, 1)
    (p / META).write_text(json.dumps({"step": 1}))
    assert verify_checkpoint(p) is None
    (p / META).write_text("{not json")
    assert "unreadable" in verify_checkpoint(p)
