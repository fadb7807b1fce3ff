"""Makes the modules named in $HIDDEN_MODULES (comma-separated) look not installed, for a test
that runs Python with this folder first on PYTHONPATH: ``importlib.util.find_spec`` finds
nothing and ``import`` raises ModuleNotFoundError, as after an install without them."""

import os
import sys
from importlib.machinery import PathFinder

HIDDEN = tuple(filter(None, os.environ.get("HIDDEN_MODULES", "").split(",")))


class _PathFinderHiding:
    """The path finder, blind to the hidden top-level modules (and everything under them)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return PathFinder.find_spec(name, path, target)

    def __getattr__(self, attr):  # find_distributions, invalidate_caches: the path finder's own
        return getattr(PathFinder, attr)


if HIDDEN:
    sys.meta_path[:] = [_PathFinderHiding() if f is PathFinder else f for f in sys.meta_path]
