"""Checkpoints of a training run: sharded (DCP, every rank writes its shards), atomic, the last
K kept, loadable into any layout; a consolidated single-file export for small models; and the
metric-log truncation for exact resume.

A checkpoint is a directory ``<checkpoint_dir>/step-00000012``. Saving writes into a hidden
temporary directory; after every rank has written (DCP gathers the ranks' write results and
rank 0 writes the metadata; then a barrier), rank 0 adds ``meta.json`` and the ``COMPLETE``
marker and renames the directory into place. A save that fails (a full or read-only disk)
removes its temporary directory and says why in one line; a killed one leaves at most that
directory, which loading ignores (and the next save of that step replaces): the last complete
checkpoint stays the one a resume finds. Older checkpoints are rotated away separately
(:func:`rotate_checkpoints`), when the loop has seen a finite step after the newest. The file
system must be shared by all ranks.

Integrity: ``meta.json`` records the size and SHA-256 of every other file of the checkpoint.
Loading verifies them (on rank 0, which tells the others); a checkpoint whose files were
damaged or truncated after the save is skipped with a one-line warning on stderr and the
newest older checkpoint that verifies is loaded instead. Rotation counts only checkpoints
that verify: it never deletes the newest one that does. Checkpoints written before the
checksums existed have none to verify and are accepted as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moe.model import ModelConfig, MoETransformer
from moe.parallel import full_state_dict
from moe.parallel.sharded_state import save_sharded
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo
from moe.training.guards import WriteFailed, write_failure

COMPLETE = "COMPLETE"
META = "meta.json"
EXPORT_NAME = "model.pt"
HF_EXPORT_NAME = "hf"
_CHUNK = 1 << 20  # bytes read at a time while hashing


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_path(checkpoint_dir: Path, step: int) -> Path:
    return checkpoint_dir / f"step-{step:08d}"


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest first (temporary directories and
    checkpoints without the marker are not listed)."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p for p in checkpoint_dir.glob("step-*") if (p / COMPLETE).exists())


def file_checksums(directory: Path) -> dict[str, dict]:
    """Relative file name -> {"bytes": size, "sha256": hex digest} of every file under
    ``directory`` except ``meta.json`` and the ``COMPLETE`` marker."""
    sums = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (META, COMPLETE)):
        digest = hashlib.sha256()
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
        sums[f.relative_to(directory).as_posix()] = {"bytes": f.stat().st_size, "sha256": digest.hexdigest()}
    return sums


def verify_checkpoint(path: Path) -> str | None:
    """None if every file recorded in ``path``'s ``meta.json`` has its size and checksum (or
    the checkpoint predates checksums), else why not, in one line."""
    try:
        recorded = json.loads((path / META).read_text()).get("checksums")
    except (OSError, ValueError) as err:
        return f"{META} unreadable ({err})"
    if recorded is None:
        return None
    for name, want in recorded.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, {want['bytes']} were written (truncated?)"
    found = file_checksums(path)
    for name, want in recorded.items():
        if found[name]["sha256"] != want["sha256"]:
            return f"{name} does not match its checksum (damaged)"
    return None


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        sys.stderr.write(f"warning: {message}\n")  # one write, as cli.fail: no launcher line inside it


def newest_verifying(checkpoints: list[Path]) -> Path | None:
    """The newest of ``checkpoints`` (oldest first) that verifies, warning once for each newer
    one that does not; None if none does. Rank 0 reads the files and tells the other ranks, so
    all load the same one; call on every rank."""
    chosen = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        for p in reversed(checkpoints):
            reason = verify_checkpoint(p)
            if reason is None:
                chosen = p
                break
            _warn(f"checkpoint {p} does not verify ({reason}); falling back to an older one")
    if dist.is_initialized():
        box = [None if chosen is None else str(chosen)]
        dist.broadcast_object_list(box, src=0)
        chosen = None if box[0] is None else Path(box[0])
    return chosen


def rotation_victims(checkpoints: list[Path], keep: int) -> list[Path]:
    """Which of ``checkpoints`` (complete, oldest first) to delete to keep the last ``keep``,
    sparing the newest one that verifies when none of the last ``keep`` does (they are checked
    newest first, so normally only the checkpoint just written is read again)."""
    victims, kept = checkpoints[:-keep], checkpoints[-keep:]
    if any(verify_checkpoint(p) is None for p in reversed(kept)):
        return victims
    spare = next((p for p in reversed(victims) if verify_checkpoint(p) is None), None)
    if spare is not None:
        _warn(f"none of the last {keep} checkpoints verifies: keeping {spare}")
    return [p for p in victims if p != spare]


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """SIGINT (Ctrl-C) arriving inside the block is held and delivered again, to the handler
    that was there before, once the block has ended. Only the main thread can handle signals:
    elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            os.kill(os.getpid(), signal.SIGINT)


@sigint_deferred()
def save_checkpoint(
    checkpoint_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    cfg: TrainConfig,
    mcfg: ModelConfig,
    info: DistInfo,
    wandb_run_id: str | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically (see the module docstring); Ctrl-C waits for
    the end of the save (:func:`sigint_deferred`, entered afresh by each call). A write that
    fails (a full or read-only disk) removes the partial directory and raises
    :class:`~moe.training.guards.WriteFailed` saying why in one line. Older checkpoints are
    rotated away by :func:`rotate_checkpoints`, not here. Call on every rank."""
    final = checkpoint_path(checkpoint_dir, step)
    tmp = checkpoint_dir / f".tmp-{final.name}"
    failure = None
    try:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        save_sharded(tmp, model, optimizer)
        _barrier()
        if info.is_main:
            meta = {
                "step": step,
                "world_size": info.world_size,
                "train_config": dataclasses.asdict(cfg),
                "model_config": dataclasses.asdict(mcfg),
                "wandb_run_id": wandb_run_id,
                "checksums": file_checksums(tmp),
            }
            (tmp / META).write_text(json.dumps(meta))
            (tmp / COMPLETE).write_text("")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except (OSError, RuntimeError, CheckpointException) as err:
        cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) else err
        failure = write_failure(cause, checkpoint_dir)
    failure = _any_failure(failure)
    if failure is not None:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        last = complete_checkpoints(checkpoint_dir)
        raise WriteFailed(
            f"could not write checkpoint {final.name} in {checkpoint_dir}: {failure}; the partial one was removed, "
            f"{f'the last complete one is {last[-1].name}' if last else 'no complete one is there'}: free space "
            "and --resume"
        )
    _barrier()
    return final


def _any_failure(failure: str | None) -> str | None:
    """The first rank's failure, known to every rank (a collective under torch.distributed)."""
    if not dist.is_initialized():
        return failure
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, failure)
    return next((f for f in every if f is not None), None)


def rotate_checkpoints(checkpoint_dir: Path, keep: int, info: DistInfo) -> None:
    """Delete all but the last ``keep`` complete checkpoints (see :func:`rotation_victims`), on
    rank 0; call on every rank."""
    if info.is_main:
        for old in rotation_victims(complete_checkpoints(checkpoint_dir), keep):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()


def resumable_checkpoint(path: Path) -> tuple[Path, dict]:
    """The complete checkpoint ``path`` if it verifies, else the newest older one in its
    directory that does (one warning line per skipped checkpoint), and its ``meta.json``
    (``step``: steps already taken, ``wandb_run_id``, ``train_config`` and ``model_config``: the
    configs that wrote it). ValueError if none verifies. Call on every rank."""
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    chosen = newest_verifying([*older, path])
    if chosen is None:
        raise ValueError(
            f"no checkpoint in {path.parent} verifies (see the warnings above); move them away to start fresh"
        )
    return chosen, json.loads((chosen / META).read_text())


def export_model(
    path: Path, model: nn.Module, mcfg: ModelConfig, info: DistInfo, pipeline_group=None, hf: dict | None = None
) -> None:
    """A consolidated single-process state dict of the model in one file (for small models:
    every rank gathers the whole model; with pipeline parallelism ``model`` is one stage and
    the stages' parts are gathered over ``pipeline_group``), with what rebuilds it: the model
    config, and for a swapped Hugging Face model ``hf`` (its transformers config as a dict,
    router, router options, backend). Written atomically by rank 0 (a failed write removes its
    temporary file and raises :class:`~moe.training.guards.WriteFailed`); call on every rank."""
    state = (
        full_state_dict(model) if info.world_size > 1 else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    )
    if pipeline_group is not None:
        parts: list[dict] = [{} for _ in range(dist.get_world_size(pipeline_group))]
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pipeline_group)
        state = {k: v for part in parts for k, v in part.items()}
    failure, tmp = None, path.with_name(f".{path.name}.tmp{os.getpid()}")
    if info.is_main:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": state, "model_config": dataclasses.asdict(mcfg), "hf": hf}, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as err:
            failure = write_failure(err, path.parent)
            tmp.unlink(missing_ok=True)
    failure = _any_failure(failure)
    if failure is not None:
        raise WriteFailed(
            f"could not write {path}: {failure}; the checkpoints are kept: free space and --export-model again"
        )
    _barrier()


def load_export(path: str | Path) -> nn.Module:
    """The model of an :func:`export_model` file, in eval mode: a ``MoETransformer``, or the
    swapped Hugging Face model (``HFCausalLM``, the ``[hf]`` extra) a ``--hf-model`` run trained.
    ValueError in one line naming ``path`` when it is missing, a folder, or not such a file."""
    p, what = Path(path), "the model.pt that a run with --export-model writes"
    if not p.is_file():
        raise ValueError(f"model file {str(p)!r} {'is a folder' if p.is_dir() else 'does not exist'}: pass {what}")
    try:
        saved = torch.load(p, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as e:  # not a torch.save file, or cut short
        raise ValueError(f"{str(p)!r} does not load as a model ({str(e).splitlines()[0]}): pass {what}") from None
    if not (isinstance(saved, dict) and "model" in saved and ("model_config" in saved or saved.get("hf"))):
        raise ValueError(f"{str(p)!r} holds no model and its config: pass {what}")
    if saved.get("hf") is not None:
        from moe.integrations.hf import hf_model_from_config  # the [hf] extra, imported only when asked for

        model = hf_model_from_config(**saved["hf"])
    else:
        model = MoETransformer(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    return model.eval()


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the records with step <= last_step (a resumed run rewrites the steps after it)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
