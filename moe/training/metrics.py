"""Per-step training metrics (loss, aux loss, drops, router entropy, expert loads) and the
wandb run they are logged to on rank 0."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.model import ModelConfig, ModelOutput
from moe.routing import Router
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo


class RouterEntropy:
    """Mean per-token entropy (nats) of each router's softmax over experts, caught by forward
    hooks on the router gates; :meth:`pop` returns the mean since the last call."""

    def __init__(self, model: nn.Module) -> None:
        self.values: list[Tensor] = []
        self.handles = [m.gate.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, module: nn.Module, inputs: tuple, logits_NE: Tensor) -> None:
        logp_NE = logits_NE.detach().float().log_softmax(-1)
        self.values.append(-(logp_NE.exp() * logp_NE).sum(-1).mean())

    def pop(self) -> Tensor:
        out = torch.stack(self.values).mean() if self.values else torch.zeros(())
        self.values.clear()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def step_metrics(out: ModelOutput, entropy: Tensor, info: DistInfo) -> dict:
    """Loss, aux loss, dropped fraction, router entropy (averaged over ranks) and per-layer
    expert loads (summed over ranks) of one training step."""
    dev = out.loss.device
    scalars = torch.stack([
        out.loss.detach().float(),
        out.aux_loss.detach().float(),
        torch.stack([r.stats["dropped_fraction"].float().to(dev) for r in out.routings]).mean()
        if out.routings else torch.zeros((), device=dev),
        entropy.to(dev),
    ])
    tokens_LE = (torch.stack([r.stats["tokens_per_expert"].to(dev) for r in out.routings])
                 if out.routings else torch.zeros(0, 0, dtype=torch.int64, device=dev))
    if info.world_size > 1:
        dist.all_reduce(scalars)
        scalars /= info.world_size
        dist.all_reduce(tokens_LE)
    loss_v, aux_v, dropped_v, entropy_v = scalars.tolist()
    load_LE = tokens_LE.double() / tokens_LE.sum(-1, keepdim=True).clamp_min(1)
    return {
        "loss": loss_v,
        "aux_loss": aux_v,
        "dropped_fraction": dropped_v,
        "router_entropy": entropy_v,
        "tokens_per_expert": tokens_LE.tolist(),
        "expert_load": load_LE.tolist(),
    }


def wandb_flat(record: dict) -> dict:
    """A metrics record as wandb scalars (per-expert load as ``load/layer{l}/expert{e}``)."""
    flat = {k: v for k, v in record.items() if k not in ("step", "tokens_per_expert", "expert_load")}
    for layer, load_E in enumerate(record.get("expert_load", [])):
        for e, v in enumerate(load_E):
            flat[f"load/layer{layer}/expert{e}"] = v
    return flat


def resolve_wandb_mode(requested: str | None) -> str:
    """The mode asked for, else $WANDB_MODE, else online iff $WANDB_API_KEY is set, else offline.
    Offline and disabled never touch the network; online is only chosen with a key (no prompt)."""
    if requested:
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def init_wandb(cfg: TrainConfig, mcfg: ModelConfig, info: DistInfo, run_id: str | None = None):
    """A wandb run on rank 0 (None elsewhere, and in disabled mode, where wandb is not imported).
    ``run_id`` (saved in checkpoints) makes a resumed run continue the same wandb run."""
    mode = resolve_wandb_mode(cfg.wandb_mode)
    if not info.is_main or mode == "disabled":
        return None
    import wandb

    run_dir = Path(cfg.wandb_dir or cfg.checkpoint_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg), "world_size": info.world_size}
    return wandb.init(
        project=cfg.wandb_project, name=cfg.wandb_run_name, config=config, dir=str(run_dir), mode=mode,
        id=run_id, resume="allow" if run_id else None, settings=wandb.Settings(silent=True),
    )
