"""Structure the maintainers rely on: short functions, one language-model loss, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

MOE = Path(__file__).resolve().parents[1] / "moe"
MAX_FUNCTION_LINES = 120


def test_no_function_in_moe_is_longer_than_120_lines():
    long = []
    for path in sorted(MOE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(MOE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long)


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


def module_name(path: Path) -> str:
    parts = path.relative_to(MOE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each moe module -> the moe modules it imports anywhere in its file: at the top, inside
    functions, under ``if TYPE_CHECKING:``. ``from pkg import name`` points at ``pkg.name`` when
    that is a module, else at ``pkg``; the implicit import of a module's parent packages is left
    out (Python resolves those circles itself)."""
    files = {module_name(p): p for p in MOE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up level - 1 packages from this one
                    up = package.split(".")[: package.count(".") + 2 - node.level]
                    base = ".".join([*up, base] if base else up)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles_among_moe_modules():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(planted) == [["a", "b", "c"]]  # the detector finds a circle it is shown
    graph = import_graph()
    assert "moe.training.config" in graph["moe.training.loop"]  # and reads the real imports
    assert not import_circles(graph), "modules of moe/ importing each other: " + "; ".join(
        " <-> ".join(c) for c in import_circles(graph)
    )
