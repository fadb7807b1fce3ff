"""The one place the audit calls its target: a fresh contiguous copy of the input for every
forward, the CPU and CUDA generators seeded before it, the random draws it makes recorded when asked,
and its exceptions turned into :class:`TargetFailure` naming the input shape.

Shape legend: B batch, T sequence, F output features per position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from moe.audit.target import AuditTarget, Outputs

Draws = tuple[tuple[str, tuple[int, ...]], ...]
"""The random draws of one forward, in order: (aten op, shape of what it drew)."""


class TargetFailure(Exception):
    """The target raised (or returned something unreadable) on one input shape."""

    def __init__(self, shape: tuple[int, ...], error: BaseException) -> None:
        self.shape, self.error = shape, error
        super().__init__(f"input of shape {shape}: {type(error).__name__}: {error}")


class _DrawRecorder(TorchDispatchMode):
    """Records every seeded random op (``nondeterministic_seeded`` tag) and the shape it drew."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.draws.append((str(func), tuple(first.shape) if isinstance(first, Tensor) else ()))
        return out


@dataclass
class Forward:
    """One call of the target."""

    out: Outputs
    draws: Draws | None
    """Its random draws, when the call asked for them (None: not recorded)."""


class Runner:
    """Calls the target: the same ``seed`` before every forward unless another is given, so two
    forwards of the same shape see the same noise where the target draws it per position."""

    def __init__(self, target: AuditTarget, seed: int) -> None:
        self.target, self.seed = target, seed

    @staticmethod
    def _reseed(seed: int) -> None:
        """Seed the CPU generator, and every CUDA generator once CUDA is in use (seeding it
        before would queue a seed for whoever initialises CUDA later)."""
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)

    def forward(self, x: Tensor, seed: int | None = None, record: bool = False) -> Forward:
        """One call of the target on a fresh copy of x; ``record``: also list its random draws
        (a dispatch mode around the call: slower, so only where the draws are compared)."""
        fresh = x.detach().clone(memory_format=torch.contiguous_format)
        self._reseed(self.seed if seed is None else seed)
        recorder = _DrawRecorder() if record else None
        try:
            if recorder is None:
                out = self.target(fresh)
            else:
                with recorder:
                    out = self.target(fresh)
        except Exception as e:  # the target's own failure: reported with the shape, never raised
            raise TargetFailure(tuple(x.shape), e) from None
        return Forward(out, tuple(recorder.draws) if recorder is not None else None)

    def forward_with_grad(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """(value_BTF with its graph, the input it is differentiated against) or None; see
        :meth:`AuditTarget.forward_with_grad`. Always under the audit seed."""
        fresh = x.detach().clone(memory_format=torch.contiguous_format)
        self._reseed(self.seed)
        try:
            return self.target.forward_with_grad(fresh)
        except Exception as e:
            raise TargetFailure(tuple(x.shape), e) from None
