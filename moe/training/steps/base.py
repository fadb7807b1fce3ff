"""The step-strategy interface and its registry.

A strategy is constructed once per run by ``moe.training.placement.place_model`` (after the
model is built, before it is sharded: it may cut the model, e.g. into a pipeline stage, and set
the placement's groups), told when placement is done (:meth:`StepStrategy.placed`), given the
optimizer (:meth:`StepStrategy.attach`), and then called every step: :meth:`gradients` fills
the gradients and the step's tally, :meth:`update` applies them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from moe.parallel.placement import Placement
from moe.parallel.state import clip_grad_norm_
from moe.training.config import TrainConfig
from moe.training.metrics import StepTally

STRATEGIES: dict[str, type[StepStrategy]] = {}
"""Name -> strategy class, in registration order."""


def register_strategy(cls: type[StepStrategy]) -> type[StepStrategy]:
    """Class decorator: add ``cls`` to :data:`STRATEGIES` under ``cls.name``."""
    if not cls.name or cls.name in STRATEGIES:
        raise ValueError(f"a step strategy needs a new name, got {cls.name!r}")
    STRATEGIES[cls.name] = cls
    return cls


def choose_strategy(cfg: TrainConfig) -> type[StepStrategy]:
    """The strategy the run's config selects: the one whose :meth:`StepStrategy.selected` is
    true, else the default one. Two selected at once is a configuration error."""
    chosen = [cls for cls in STRATEGIES.values() if cls.selected(cfg)]
    if len(chosen) > 1:
        raise ValueError(f"the configuration asks for several ways of stepping at once: {[c.name for c in chosen]}")
    if chosen:
        return chosen[0]
    return next(cls for cls in STRATEGIES.values() if cls.default)


class StepStrategy(ABC):
    """How one rank makes and applies a step's gradients. ``place`` is the rank's
    :class:`~moe.parallel.placement.Placement` (model, groups, device), ``cfg`` the run's config."""

    name: ClassVar[str] = ""
    default: ClassVar[bool] = False
    """The strategy of a config that selects no other (exactly one has it)."""
    uses_mesh: ClassVar[bool] = True
    """Whether the model lives on the DeviceMesh (FSDP2 / expert parallel) on more than one process."""

    @staticmethod
    def selected(cfg: TrainConfig) -> bool:
        """Whether ``cfg`` asks for this strategy (the default strategy: never asked for by name)."""
        return False

    @staticmethod
    def check_world(world_size: int) -> None:
        """ValueError if the strategy cannot run on ``world_size`` processes (any number by default)."""
        return None

    def __init__(self, place: Placement, cfg: TrainConfig) -> None:
        self.place, self.cfg = place, cfg
        self.optimizer: torch.optim.Optimizer | None = None

    def placed(self) -> None:
        """Called once the model is sharded (nothing to finish by default)."""
        return None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer of the placed model's parameters."""
        self.optimizer = optimizer

    @abstractmethod
    def gradients(self, idx_BT: Tensor, targets_BT: Tensor, tally: StepTally) -> None:
        """Forward and backward of this rank's batch: gradients left in the parameters, every
        microbatch's loss and routing added to ``tally``."""

    def update(self, step: int) -> tuple[float, dict]:
        """Apply the gradients: clip the whole model's norm (over the pipeline stages), step the
        optimizer. Returns (gradient norm before clipping, extra metrics of the step)."""
        place = self.place
        metrics = place.reduce_hook.pop(place.device) if place.reduce_hook is not None else {}
        clip = self.cfg.optimizer.grad_clip
        norm = clip_grad_norm_(place.model, clip if clip > 0 else float("inf"), place.pp_group, place.uncounted())
        self.optimizer.step()
        return float(norm), metrics
