"""The optional extras of pyproject.toml that parts above the core need, imported when used.

The core (``MoELayer``, the routers, the model, ``moe-audit``) needs torch, numpy and tqdm only.
The trainer's command line needs tyro (``[train]``), its logging wandb (``[wandb]``), the
experiments' figures matplotlib (``[plot]``): :func:`require` imports one, or raises
:class:`MissingExtra` whose one line names the extra that brings it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """A module of an optional extra is not installed (the message names the extra)."""


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra`: "<needed_by> needs <package>: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        package = module.split(".")[0]
        if e.name != package:  # the package is there, something it imports is not: its own error
            raise
        raise MissingExtra(
            f"{needed_by} needs {package}, which is not installed: pip install 'causal-moe-routing[{extra}]' "
            f"(in a checkout: pip install -e '.[{extra}]')",
            name=package,
        ) from None


def pyplot(needed_by: str) -> ModuleType:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or :class:`MissingExtra` naming ``[plot]``."""
    require("matplotlib", "plot", needed_by).use("Agg")
    return require("matplotlib.pyplot", "plot", needed_by)
