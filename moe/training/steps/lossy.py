"""Data parallelism over a simulated lossy transport (``moe.parallel.lossy``) as a step
strategy, configured by the run's ``[lossy]`` section (``moe.training.parallel_config.LossyConfig``):
every parameter replicated (no mesh, no FSDP2), gradients reduce-scattered to shard owners over
packets that may be lost, owners update, parameters broadcast back."""

from __future__ import annotations

import torch

from moe.parallel.lossy import METRICS, LossyDataParallel
from moe.training.config import TrainConfig
from moe.training.steps.base import register_strategy
from moe.training.steps.plain import Plain


@register_strategy
class LossyDataParallelStep(Plain):
    """The plain forward and backward on every replica; :class:`LossyDataParallel` aggregates,
    clips, updates and broadcasts."""

    name = "lossy"
    uses_mesh = False

    @staticmethod
    def selected(cfg: TrainConfig) -> bool:
        return cfg.lossy.packet_loss > 0

    @staticmethod
    def check_world(world_size: int) -> None:
        if world_size == 1:
            raise ValueError(
                "--packet-loss simulates data parallelism over a lossy network: launch at least 2 "
                "processes (torchrun --nproc-per-node N)"
            )

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach(optimizer)
        dp_cfg = self.cfg.lossy.transport(self.cfg.seed, self.cfg.optimizer.grad_clip)
        self.transport = LossyDataParallel(self.place.model, optimizer, dp_cfg)

    def update(self, step: int) -> tuple[float, dict]:
        info = self.transport.step(step)
        return float(info["grad_norm"]), {k: info[k] for k in METRICS}
