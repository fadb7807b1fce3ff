"""Per-phase wall-clock timing of the expert-parallel data path (forward and backward).

Forward phases are timed with :meth:`PhaseTimer.phase`. Backward phases cannot be wrapped
in a ``with`` block (autograd runs them), so :meth:`PhaseTimer.mark` inserts an identity
autograd node at a phase boundary; its backward records when the gradient passed through,
and :meth:`PhaseTimer.backward_split` turns those stamps into per-phase durations. On CUDA
every stamp synchronises the device first, so the numbers are real (and the run slower):
use a timer for benchmarks only; ``timer=None`` costs nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


class PhaseTimer:
    """Accumulates seconds per phase name; ``forward`` holds forward-pass phases."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.forward: dict[str, float] = defaultdict(float)
        self.stamps: dict[str, float] = {}

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.now()
        yield
        self.forward[name] += self.now() - start

    def mark(self, x: Tensor, name: str) -> Tensor:
        """Identity on ``x`` whose backward stamps the time under ``name``."""
        return _Mark.apply(x, self, name) if x.requires_grad else x

    def backward_split(self, start: float, end: float, boundaries: list[tuple[str, str]]) -> dict[str, float]:
        """Durations of backward phases from stamps. ``boundaries`` lists (phase, mark that
        ends it) in backward order; the first phase starts at ``start``, a phase whose end
        mark is "" ends at ``end``. A phase whose mark never fired counts zero."""
        out: dict[str, float] = defaultdict(float)
        prev = start
        for phase, mark in boundaries:
            stop = end if mark == "" else self.stamps.get(mark, prev)
            out[phase] += max(stop - prev, 0.0)
            prev = stop
        return dict(out)

    def reset(self) -> None:
        self.forward.clear()
        self.stamps.clear()


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, timer: PhaseTimer, name: str) -> Tensor:
        ctx.timer, ctx.name = timer, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.timer.stamps[ctx.name] = ctx.timer.now()
        return grad, None, None
