"""Process-group setup for the training loop (torchrun's environment, gloo on CPU, NCCL on
CUDA) and the synchronisation of router state across ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.routing import Router
from moe.training.config import TrainConfig


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False
    """True when :func:`setup_distributed` created the process group (and must destroy it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str = "auto") -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; join the process group (gloo on CPU,
    NCCL on CUDA) when WORLD_SIZE > 1 and none exists; pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, dev, owns)


def check_expert_parallel(cfg: TrainConfig, info: DistInfo) -> None:
    """``--expert-parallel N`` shards the experts over every rank: N must be the world size."""
    if cfg.expert_parallel not in (1, info.world_size):
        raise ValueError(
            f"--expert-parallel {cfg.expert_parallel} must equal the number of processes ({info.world_size}): "
            f"launch with torchrun --nproc-per-node {cfg.expert_parallel}"
        )


def sync_router_state(model: nn.Module, info: DistInfo) -> None:
    """Average the routers' floating buffers over ranks before ``update_routers``.

    Router buffers are either identical on every rank (balancing biases, threshold averages:
    averaging keeps them) or statistics of the local batch (loads seen, pending cut-offs:
    averaging gives the global batch's statistic up to a common scale that the routers'
    updates do not depend on), so every rank folds in the same global-batch update.
    """
    if info.world_size == 1:
        return
    for m in model.modules():
        if isinstance(m, Router):
            for buf in m.buffers(recurse=False):
                if buf.is_floating_point():
                    dist.all_reduce(buf)
                    buf /= info.world_size
