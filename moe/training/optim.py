"""The optimizer section of a run: AdamW (matrices decayed, norms not), linear warmup and
cosine decay over the schedule's steps (the run's, unless a resumed run keeps the one it
started with), gradient clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adam import adam

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
    return BlockedAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


class BlockedAdamW(torch.optim.AdamW):
    """torch's AdamW with the same numbers, stepped in blocks of at most ``BLOCK`` elements where
    torch would run its for-loop implementation (plain contiguous CPU tensors, no amsgrad): each
    parameter's flat view is cut into blocks, and torch's own single-tensor AdamW runs block by
    block. AdamW is elementwise, so every element sees the same operations as in one call on the
    whole tensor (blocks start at multiples of ``BLOCK``, a multiple of every SIMD width, so each
    element also takes the same vectorised path): the weights and states are bitwise torch's
    (``tests/test_optim.py``). Elsewhere (CUDA, FSDP2's DTensors, foreach or fused asked for) it
    is torch's AdamW unchanged. Its state dict is torch's.

    Why: on CPU the for-loop runs each of its eight operations over the whole tensor in turn, and
    each makes a temporary of the tensor's size; the MoE experts' stacked [E, D, F] weights are
    megabytes, out of cache and above the loop's malloc mmap threshold (``cpu_mmap_threshold_kib``),
    so every pass streams memory and every temporary is fresh, page-faulted memory. Blocked, a
    parameter's operations run on a cached block (docs/benchmarks.md: 2.7x faster for the study's
    large MoE model, 2.35x for its baby one). Measured later on quiet cores, the page faults were
    the whole gain: where freed memory is kept (``cpu_malloc_keep``) the two run alike (0.91-1.00x
    of torch's for-loop)."""

    BLOCK = 1 << 17
    """Elements per block (512 KiB of fp32): fewer, longer blocks cost more memory traffic,
    shorter ones more Python per operation (measured: 2^16 and 2^17 best at the study's sizes)."""

    def step(self, closure=None):
        if not all(self._blockable(g) for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _blockable(self, group: dict) -> bool:
        plain = all(
            type(p) in (nn.Parameter, torch.Tensor)
            and p.device.type == "cpu"
            and p.is_contiguous()
            and not p.is_complex()
            and (p.grad is None or (type(p.grad) is torch.Tensor and p.grad.is_contiguous() and not p.grad.is_sparse))
            and all(t.is_contiguous() for t in self.state.get(p, {}).values())  # e.g. states loaded from a checkpoint
            for p in group["params"]
        )
        options = not (group["foreach"] or group["fused"] or group["capturable"] or group["differentiable"])
        return plain and options and not group["amsgrad"]

    def _step_group(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
        blocks: list[list[torch.Tensor]] = [[], [], [], [], []]
        counted = []  # (a cut parameter's step, the copy that its first block counted on)
        for *tensors, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            if tensors[0].numel() <= self.BLOCK:
                pieces, step_copies = [[t.detach()] for t in tensors], [step]
            else:
                pieces = [t.detach().view(-1).split(self.BLOCK) for t in tensors]
                step_copies = [step.clone() for _ in pieces[0]]  # each block counts the step once
                counted.append((step, step_copies[0]))
            for i, piece in enumerate(pieces):
                blocks[i] += piece
            blocks[4] += step_copies
        beta1, beta2 = group["betas"]
        adam(
            *blocks[:4],
            [],
            blocks[4],
            foreach=False,
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )
        for step, copy in counted:
            step.copy_(copy)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
