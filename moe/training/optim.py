"""The optimizer section of a run: AdamW (matrices decayed, norms not), linear warmup and
cosine decay over the schedule's steps (the run's, unless a resumed run keeps the one it
started with), gradient clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moe.checks import nonnegative_int, positive_int


@dataclass
class OptimizerConfig:
    """How many optimizer steps, and how each moves the weights."""

    steps: int = 300
    """Optimizer steps."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of ``lr``."""
    warmup_steps: int | None = None
    """Linear warmup steps; None = min(30, schedule // 10), so a short run is not all warmup
    (300 steps: 30; 12 steps: 1)."""
    schedule_steps: int | None = None
    """The learning-rate schedule's length: warmup, cosine decay to ``lr * min_lr_ratio`` at
    this step, that final rate after it. None: ``steps``; with ``--resume``, the schedule the
    checkpoint's run started with (so changing ``--steps`` on a resume keeps it; give this to
    stretch the schedule to the new ``--steps`` instead)."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only; norms are not decayed)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""

    def __post_init__(self) -> None:
        positive_int("steps", self.steps)
        if self.schedule_steps is not None:
            positive_int("schedule_steps", self.schedule_steps)
        if self.warmup_steps is not None:
            nonnegative_int("warmup_steps", self.warmup_steps)
        for name, ok, rule in (  # each value is judged alone: an error names only what is wrong
            ("lr", 0 < self.lr < math.inf, "finite and > 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "finite and >= 0"),
            ("grad_clip", self.grad_clip >= 0, ">= 0"),
            ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @property
    def schedule(self) -> int:
        """The schedule's length in force: ``schedule_steps``, or ``steps`` when None."""
        return self.steps if self.schedule_steps is None else self.schedule_steps

    @property
    def warmup(self) -> int:
        """The warmup steps in force: ``warmup_steps``, or min(30, schedule // 10) when None."""
        return min(30, self.schedule // 10) if self.warmup_steps is None else self.warmup_steps


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine decay to
    ``lr * min_lr_ratio`` at the schedule's last step, and that rate after it."""
    warmup = cfg.warmup
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.schedule - 1 - warmup)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
