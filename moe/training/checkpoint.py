"""Checkpoints of a training run: sharded (DCP, every rank writes its shards), atomic, the last
K kept, loadable into any layout; a consolidated single-file export for small models; and the
metric-log truncation for exact resume.

A checkpoint is a directory ``<checkpoint_dir>/step-00000012``. Saving writes into a hidden
temporary directory; after every rank has written (DCP gathers the ranks' write results and
rank 0 writes the metadata; then a barrier), rank 0 adds ``meta.json`` and the ``COMPLETE``
marker and renames the directory into place. An interrupted save leaves at most a temporary
directory, which loading ignores (and the next save of that step replaces): the last complete
checkpoint stays the one a resume finds. The file system must be shared by all ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe.model import ModelConfig
from moe.parallel import full_state_dict
from moe.parallel.checkpoint import load_sharded, save_sharded
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo

COMPLETE = "COMPLETE"
META = "meta.json"
EXPORT_NAME = "model.pt"


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


def save_checkpoint(checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    cfg: TrainConfig, mcfg: ModelConfig, info: DistInfo, keep: int,
                    wandb_run_id: str | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically (see the module docstring) and delete all but
    the last ``keep`` complete ones. Call on every rank."""
    final = checkpoint_path(checkpoint_dir, step)
    tmp = checkpoint_dir / f".tmp-{final.name}"
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
        }
        (tmp / META).write_text(json.dumps(meta))
        (tmp / COMPLETE).write_text("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(checkpoint_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    mcfg: ModelConfig) -> tuple[int, str | None]:
    """Restore model and optimizer from the complete checkpoint ``path`` (any layout); return
    (steps already taken, wandb run id). Call on every rank."""
    meta = json.loads((path / META).read_text())
    if meta["model_config"] != dataclasses.asdict(mcfg):
        raise ValueError(f"checkpoint {path} was written for a different model: {meta['model_config']}")
    load_sharded(path, model, optimizer)
    return int(meta["step"]), meta.get("wandb_run_id")


def export_model(path: Path, model: nn.Module, mcfg: ModelConfig, info: DistInfo, pipeline_group=None) -> None:
    """A consolidated single-process state dict of the model in one file (for small models:
    every rank gathers the whole model; with pipeline parallelism ``model`` is one stage and
    the stages' parts are gathered over ``pipeline_group``). Written atomically by rank 0;
    call on every rank."""
    state = full_state_dict(model) if info.world_size > 1 else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if pipeline_group is not None:
        parts: list[dict] = [{} for _ in range(dist.get_world_size(pipeline_group))]
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pipeline_group)
        state = {k: v for part in parts for k, v in part.items()}
    if info.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        torch.save({"model": state, "model_config": dataclasses.asdict(mcfg)}, tmp)
        os.replace(tmp, path)
    _barrier()


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the records with step <= last_step (a resumed run rewrites the steps after it)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
