"""Atomic single-process checkpoints (sharded experts gathered first) and metric-log
truncation for exact resume."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from moe.model import ModelConfig
from moe.parallel import full_optimizer_state_dict, full_state_dict, load_full_optimizer_state_dict, load_full_state_dict
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo

CHECKPOINT_NAME = "ckpt.pt"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    mcfg: ModelConfig, info: DistInfo | None = None, wandb_run_id: str | None = None) -> None:
    """Write the checkpoint atomically (a temporary file in the same directory, then rename) on
    rank 0. Call on every rank: sharded experts and their optimizer state are gathered first,
    so the file is a single-process checkpoint, loadable on any number of processes."""
    model_state, optimizer_state = full_state_dict(model), full_optimizer_state_dict(model, optimizer)
    if info is not None and not info.is_main:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    state = {
        "step": step,
        "model": model_state,
        "optimizer": optimizer_state,
        "train_config": dataclasses.asdict(cfg),
        "model_config": dataclasses.asdict(mcfg),
        "wandb_run_id": wandb_run_id,
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    mcfg: ModelConfig) -> tuple[int, str | None]:
    """Restore model and optimizer from ``path`` (sharding experts as the model needs); return
    (steps already taken, wandb run id)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["model_config"] != dataclasses.asdict(mcfg):
        raise ValueError(f"checkpoint {path} was written for a different model: {state['model_config']}")
    load_full_state_dict(model, state["model"])
    load_full_optimizer_state_dict(model, optimizer, state["optimizer"])
    return int(state["step"]), state.get("wandb_run_id")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the records with step <= last_step (a resumed run rewrites the steps after it)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
