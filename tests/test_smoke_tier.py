"""The smoke tier (``pytest -m smoke``, tests/smoke.py) names tests that exist: a renamed or
removed test would silently shrink it."""

from __future__ import annotations

import re

from helpers import ROOT
from smoke import SMOKE


def test_every_smoke_entry_names_a_test_function_of_the_suite():
    for nodeid in SMOKE:
        path, name = re.fullmatch(r"(tests/test_\w+\.py)::(\w+)(\[.+\])?", nodeid).group(1, 2)
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{nodeid}: no such test"
