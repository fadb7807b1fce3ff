"""P logical data-parallel workers in one process: lossy data parallelism at any P on one core.

Shape legend: P workers, n elements of the flat parameter vector.

Each worker has its own replica of the parameters (a deep copy of the model: replicas drift
apart where broadcast packets are lost, exactly as the processes' copies do), its own optimizer,
its own micro-batch and its own gradient; the caller runs every replica's forward and
backward, then :meth:`SimulatedDataParallel.step` runs the step of
:class:`~moe.parallel.lossy.data_parallel.LossyReplicas`, the one :class:`LossyDataParallel`
runs on one replica per process: the same transport deciding which packets between which
workers are lost (the pattern is a function of (seed, step, stream, source, destination,
packet), so worker j here loses what rank j loses there), the same shard-owner aggregation,
the same owners' update and the same broadcast. Only the sums differ: a sum over the workers
in a fixed order here, gloo's all-reduce there, which agree to fp32 rounding.

    sim = SimulatedDataParallel(model, lambda m: torch.optim.AdamW(m.parameters()), cfg, workers=64)
    for model_i, batch_i in zip(sim.replicas, batches):     # every worker's forward and backward
        model_i(batch_i).backward()
    metrics = sim.step(step)

Routers: a router's load-balancing loss counts its assignments over its own worker's batch
here (the replicas share no process group), so a multi-process run whose routers count them
over all ranks (``share_router_statistics``) is reproduced only without that loss
(``aux_loss_coef=0``). Buffer state (aux-loss-free balancing) is averaged over the replicas by
:meth:`SimulatedDataParallel.average_buffers`, as the training loop's all-reduce averages it
over ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from moe.parallel.lossy.data_parallel import LossyDPConfig, LossyReplicas
from moe.parallel.lossy.transport import Workers


class SimulatedDataParallel(LossyReplicas):
    """``workers`` replicas of ``model`` (the first is ``model`` itself, the others deep copies,
    so all start equal), each with ``make_optimizer(replica)``, trained by lossy data-parallel
    steps in this process (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        cfg: LossyDPConfig,
        workers: int,
    ):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 2:
            raise ValueError(f"workers must be an integer >= 2 (data parallelism needs two), got {workers!r}")
        replicas = [model] + [copy.deepcopy(model) for _ in range(workers - 1)]
        super().__init__(replicas, [make_optimizer(m) for m in replicas], cfg, Workers.in_process(workers))

    @property
    def replicas(self) -> list[nn.Module]:
        """Worker i's model, i = 0..P-1."""
        return self.models

    @torch.no_grad()
    def average_buffers(self, select: Callable[[nn.Module], bool]) -> None:
        """Replace the floating buffers (their own, not their children's) of every module that
        ``select`` picks by their mean over the replicas: a sum over the workers, then / P, as an
        all-reduce mean over ranks computes it (``moe.training.distributed.sync_router_state``)."""
        modules = [[m for m in replica.modules() if select(m)] for replica in self.replicas]
        for group in zip(*modules):
            for bufs in zip(*(m.buffers(recurse=False) for m in group)):
                if bufs[0].is_floating_point():
                    mean = self.workers.sum(torch.stack(bufs)) / self.workers.size
                    for buf in bufs:
                        buf.copy_(mean)
