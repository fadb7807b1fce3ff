"""Data parallelism over a simulated lossy transport (``moe.parallel.lossy``) as a step
strategy, with its section of the run's config (:class:`LossyConfig`): every parameter
replicated (no mesh, no FSDP2), gradients reduce-scattered to shard owners over packets that
may be lost, owners update, parameters broadcast back."""

from __future__ import annotations

from dataclasses import dataclass

from moe.checks import nonnegative_int, positive_int
from moe.parallel.lossy import METRICS, LossConfig, LossyDataParallel, LossyDPConfig
from moe.parallel.steps.base import register_strategy
from moe.parallel.steps.plain import Plain


@dataclass
class LossyConfig:
    """The lossy transport of a data-parallel run (off unless ``packet_loss`` > 0)."""

    packet_loss: float = 0.0
    """p > 0: data parallelism over a simulated lossy transport (``moe.parallel.lossy``): every
    parameter replicated, gradients reduce-scattered to shard owners and parameters broadcast
    back, each packet lost with probability p (FSDP2 is not used). Logs received_fraction,
    grad_rel_error, grad_bias (against the reliable mean of the same gradients), max_drift and
    rms_drift (spread between the ranks' replicas) every step."""
    loss_policy: str = "unbiased"
    """With packet_loss: what a shard owner makes of the packets that arrived: unbiased (average
    of what arrived), naive (lost packets count as zeros), reweighted (inverse-probability
    weights) or reliable (the baseline: the transport is bypassed)."""
    loss_burst: float = 0.0
    """With packet_loss: mean burst length of lost packets (Gilbert's channel); 0 = independent losses."""
    loss_packet_size: int = 1024
    """With packet_loss: elements per packet."""
    loss_resync_every: int = 0
    """With packet_loss: every K-th parameter broadcast is reliable (0 = never)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.packet_loss < 1.0:
            raise ValueError(f"packet_loss must be in [0, 1), got {self.packet_loss!r}")
        if self.loss_burst != 0.0 and self.loss_burst < 1.0:
            raise ValueError(
                f"loss_burst must be 0 (independent losses) or a mean burst length >= 1, got {self.loss_burst!r}"
            )
        positive_int("loss_packet_size", self.loss_packet_size)
        nonnegative_int("loss_resync_every", self.loss_resync_every)
        self.transport(seed=0, grad_clip=0.0)  # validates the policy

    def transport(self, seed: int, grad_clip: float) -> LossyDPConfig:
        """The ``moe.parallel.lossy`` configuration (the loss pattern seeded by ``seed``)."""
        loss = LossConfig(
            rate=self.packet_loss, packet_size=self.loss_packet_size, burst_length=self.loss_burst or None, seed=seed
        )
        return LossyDPConfig(
            policy=self.loss_policy, loss=loss, resync_every=self.loss_resync_every, grad_clip=grad_clip
        )


@register_strategy
class LossyDataParallelStep(Plain):
    """The plain forward and backward on every replica; :class:`LossyDataParallel` aggregates,
    clips, updates and broadcasts."""

    name = "lossy"
    uses_mesh = False

    @staticmethod
    def selected(cfg) -> bool:
        return cfg.lossy.packet_loss > 0

    @staticmethod
    def check_world(world_size: int) -> None:
        if world_size == 1:
            raise ValueError(
                "--packet-loss simulates data parallelism over a lossy network: launch at least 2 "
                "processes (torchrun --nproc-per-node N)"
            )

    def attach(self, optimizer) -> None:
        super().attach(optimizer)
        dp_cfg = self.cfg.lossy.transport(self.cfg.seed, self.cfg.optimizer.grad_clip)
        self.transport = LossyDataParallel(self.place.model, optimizer, dp_cfg)

    def update(self, step: int) -> tuple[float, dict]:
        info = self.transport.step(step)
        return float(info["grad_norm"]), {k: info[k] for k in METRICS}
