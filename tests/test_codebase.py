"""Structure the maintainers rely on: short functions, one language-model loss."""

from __future__ import annotations

import ast
from pathlib import Path

MOE = Path(__file__).resolve().parents[1] / "moe"
MAX_FUNCTION_LINES = 80


def test_no_function_in_moe_is_longer_than_80_lines():
    long = []
    for path in sorted(MOE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(MOE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines: " + ", ".join(long)


def test_the_language_model_loss_is_computed_in_one_place():
    """The token loss is moe/lm.py's lm_loss; the only other cross entropy is ec_predictor's
    binary loss of its causal predictor."""
    places = sorted(
        f"{p.relative_to(MOE.parent)}:{i}"
        for p in MOE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "cross_entropy" in line
    )
    assert len(places) <= 2 and [p.split(":")[0] for p in places] == ["moe/lm.py", "moe/routers/ec_predictor.py"], (
        places
    )
