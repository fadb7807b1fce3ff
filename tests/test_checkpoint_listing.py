"""Which checkpoints a run resumes from and rotates (moe/training/checkpoint_files.py): only the
complete ones (a ``step-*`` folder holding the ``COMPLETE`` marker), oldest first by step, never a
folder without the marker nor a temporary one; and a fresh run refuses a folder holding any
``step-*`` entry or an exported model, complete or not."""

from __future__ import annotations

import pytest

from moe.training.checkpoint_files import COMPLETE, EXPORT_NAME, checkpoint_path, complete_checkpoints
from moe.training.resume import refuse_foreign


def make(folder, step: int, complete: bool):
    p = checkpoint_path(folder, step)
    p.mkdir(parents=True)
    (p / "shard.bin").write_bytes(b"x")
    if complete:
        (p / COMPLETE).write_text("")
    return p


def test_only_complete_checkpoints_are_listed_oldest_first(tmp_path):
    want = [make(tmp_path, s, True) for s in (9, 10, 100)]
    make(tmp_path, 4, False)  # a step folder without the marker
    make(tmp_path, 200, False)  # the newest, but incomplete
    (tmp_path / f".tmp-{checkpoint_path(tmp_path, 300).name}").mkdir()
    (tmp_path / f".tmp-{checkpoint_path(tmp_path, 300).name}" / COMPLETE).write_text("")
    assert complete_checkpoints(tmp_path) == sorted(want) == [checkpoint_path(tmp_path, s) for s in (9, 10, 100)]
    assert complete_checkpoints(tmp_path / "absent") == []


@pytest.mark.parametrize("what", ["complete", "incomplete", "export"])
def test_a_fresh_run_refuses_a_folder_holding_any_checkpoint(tmp_path, what):
    if what == "export":
        (tmp_path / EXPORT_NAME).write_bytes(b"x")
    else:
        make(tmp_path, 2, what == "complete")
    with pytest.raises(ValueError, match="holds another run's checkpoints"):
        refuse_foreign(tmp_path)
    refuse_foreign(tmp_path / "empty-or-absent")  # nothing there: allowed
    (tmp_path / "fresh").mkdir()
    refuse_foreign(tmp_path / "fresh")
