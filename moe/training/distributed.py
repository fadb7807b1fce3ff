"""Process-group setup for the training loop (torchrun's environment, gloo on CPU, NCCL on
CUDA) and the synchronisation of router state across ranks."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.routing import Router


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


def setup_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; join the process group (gloo on CPU,
    NCCL on CUDA, every collective bounded by ``timeout_s``) when WORLD_SIZE > 1 and none
    exists; pick the device."""
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
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # torchrun --max-restarts keeps the store of the first attempt: without a fresh prefix a
        # restarted rank reads the dead attempt's addresses and fails to connect (measured).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            timeout=timeout,
            store=dist.PrefixStore(f"moe/attempt{attempt}", store),
            rank=rank,
            world_size=world,
        )
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, dev, owns)


FAULT_STEP_ENV = "MOE_FAULT_AT_STEP"
FAULT_RANK_ENV = "MOE_FAULT_RANK"


def inject_fault(step: int, info: DistInfo) -> None:
    """Fault injection for restart tests: when $MOE_FAULT_AT_STEP equals ``step`` and this is
    rank $MOE_FAULT_RANK (default 1) on torchrun's first attempt ($TORCHELASTIC_RESTART_COUNT
    0 or unset), the process dies at once (exit code 17), as a crashed rank would."""
    at = os.environ.get(FAULT_STEP_ENV)
    if at is None or int(at) != step or int(os.environ.get(FAULT_RANK_ENV, "1")) != info.rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        os._exit(17)


def sync_router_state(model: nn.Module, info: DistInfo, group=None) -> None:
    """Average the routers' floating buffers over the ranks of ``group`` (default: all), which
    must hold the same routers (with pipeline parallelism: one stage's data-parallel ranks),
    before ``update_routers``.

    Router buffers are either identical on every rank (balancing biases, threshold averages:
    averaging keeps them) or statistics of the local batch (loads seen, pending cut-offs:
    averaging gives the global batch's statistic up to a common scale that the routers'
    updates do not depend on), so every rank folds in the same global-batch update.
    """
    if info.world_size == 1:
        return
    size = dist.get_world_size(group)
    if size == 1:
        return
    for m in model.modules():
        if isinstance(m, Router):
            for buf in m.buffers(recurse=False):
                if buf.is_floating_point():
                    dist.all_reduce(buf, group=group)
                    buf /= size
