"""Step strategies: how a placed model makes and applies one optimizer step's gradients
(plain or accumulating over microbatches, pipelined, lossy data parallel). One strategy per
run, chosen by :func:`choose_strategy` when the model is placed (``moe.training.placement``).

A new way of stepping is one new module in this package defining a subclass of
:class:`StepStrategy` decorated with :func:`register_strategy`: every module here is imported
below, so the registry sees it without an edit anywhere else.
"""

import importlib
import pkgutil

from moe.training.steps.base import STRATEGIES, StepStrategy, choose_strategy, register_strategy

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["STRATEGIES", "StepStrategy", "choose_strategy", "register_strategy"]
