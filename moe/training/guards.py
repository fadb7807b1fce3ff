"""What stops a run in one line rather than keep what cannot be trusted or end in a traceback:
a non-finite loss, gradient norm or weights (:class:`Diverged`), folders it cannot write and a
full disk (:class:`WriteFailed`); and the warning of a loss worse than a uniform guess."""

from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WORSE_THAN_UNIFORM = 2.0
"""A training loss above this many times ln V (a uniform guess over the vocabulary) is
diverging: the run warns once, and checkpoints written while it lasts rotate no older one away."""
CHECKED = ("loss", "grad_norm", "aux_loss")
"""The figures of a step's record that must be finite."""
FINAL_CHECKED = ("teacher_forced_loss", "causal_loss")
"""The figures of the final evaluation that must be finite (it is the last checkpoint's first forward)."""


class RunStopped(RuntimeError):
    """The run stopped after it started for a reason said in one line (``experiments/train.py``
    prints it and exits 1); the checkpoints already written are kept as they were."""


class Diverged(RunStopped):
    """A step's loss, gradient norm or weights are not finite."""


class WriteFailed(RunStopped):
    """A checkpoint or the metrics JSONL could not be written (a full or read-only disk)."""


def non_finite(record: dict, keys: tuple[str, ...] = CHECKED) -> list[str]:
    """``["loss nan", "grad_norm inf"]``: the figures of ``keys`` in ``record`` that are not finite."""
    return [f"{k} {record[k]}" for k in keys if k in record and not math.isfinite(record[k])]


def weights_finite(model: nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of ``model`` (this rank's shards) is
    finite on every rank (a collective under torch.distributed)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.parameters(), *model.buffers()]]
    checks = [torch.isfinite(t).all() for t in local if t.is_floating_point() and t.numel()]
    ok = torch.stack(checks).all().to(torch.float32) if checks else torch.ones(())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


def worse_than_uniform(loss: float, vocab_size: int) -> bool:
    return loss > WORSE_THAN_UNIFORM * math.log(vocab_size)


def check_writable(folder: Path, what: str) -> None:
    """ValueError in one line unless ``folder`` exists (or can be made) and takes a file (the
    probe is removed: nothing is left behind)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {folder} is not writable ({e.strerror or e}): use another folder") from None


def on_rank0_for_all(check: Callable[[], None]) -> None:
    """Run ``check`` on rank 0 alone (it touches the shared disk) and raise its ValueError on
    every rank, so that all stop together (a collective under torch.distributed)."""
    failure = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check()
        except ValueError as e:
            failure = str(e)
    if dist.is_initialized():
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        raise ValueError(failure)


def check_outputs(checkpoint_dir: Path | None, metrics_jsonl: str | None) -> None:
    """ValueError in one line unless the run can write its checkpoints and its metrics JSONL
    (an existing one is opened for appending, not changed): checked before the first step."""
    if checkpoint_dir is not None:
        check_writable(checkpoint_dir, "--checkpoint-dir")
    if metrics_jsonl:
        path = Path(metrics_jsonl)
        check_writable(path.parent, f"--metrics-jsonl {path}: its folder")
        try:
            if path.exists():
                with path.open("a"):
                    pass
        except OSError as e:
            raise ValueError(f"--metrics-jsonl {path} is not writable ({e.strerror or e}): use another file") from None


def check_room(folder: Path, needed_bytes: int) -> None:
    """ValueError in one line if the disk of ``folder`` has less free space than one checkpoint needs."""
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise ValueError(
            f"--checkpoint-dir {folder} has {free / 2**20:.1f} MiB free, one checkpoint of this run needs at least "
            f"{needed_bytes / 2**20:.1f} MiB: free some space or use another --checkpoint-dir"
        )


def write_failure(err: Exception, folder: Path) -> str:
    """Why a write into ``folder`` failed, in words: "no space left on device" also where torch's
    writer reports a short write only as a RuntimeError (``unexpected pos``) and the disk is full."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return "no space left on device"
    if isinstance(err, OSError):
        return err.strerror or str(err)
    if shutil.disk_usage(folder).free < 2**20:
        return "no space left on device"
    return str(err).strip().splitlines()[-1]
