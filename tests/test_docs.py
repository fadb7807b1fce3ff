"""The documentation stays true: every ```python block of README.md and docs/*.md runs, and
every relative link points at an existing file and heading.

Each block runs alone, in a fresh namespace, as a reader who pastes it runs it: a block that
needs a name (``torch``, a model) imports or builds it itself. Each is its own test, named by
page and block number. ```python hf blocks need transformers (the [hf] extra) and are skipped
without it.
A block that needs what the default suite lacks (a GPU, several processes, minutes) is written
as ```bash or ```text, or, sparingly, marked by an HTML comment on the line before its fence:
``<!-- no-test: the reason -->``.
"""

import importlib.util
import re
from pathlib import Path

import pytest
from extras import reason

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- no-test: (?P<reason>[^\n]*?) -->\n)?```python(?P<hf> hf)?\n(?P<code>.*?)```", re.DOTALL)
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def page_blocks(page: Path) -> list[re.Match]:
    return list(BLOCK.finditer(page.read_text()))


CASES = [pytest.param(page, i, id=f"{page_name(page)}#{i}") for page in PAGES for i in range(len(page_blocks(page)))]


@pytest.mark.parametrize(("page", "index"), CASES)
def test_python_block_runs_alone(page: Path, index: int):
    """Each block in a fresh namespace, as a reader pastes it: its imports and names are its own."""
    block = page_blocks(page)[index]
    if block["reason"] is not None:
        pytest.skip(f"marked no-test: {block['reason']}")
    if block["hf"] is not None and not HAS_TRANSFORMERS:
        pytest.skip(f"a ```python hf block: {reason('transformers', 'hf')}")
    name = f"{page_name(page)} python block {index}"
    try:
        exec(compile(block["code"], name, "exec"), {"__name__": "__main__"})
    except Exception as e:
        raise AssertionError(f"{name} failed when run alone: {e!r}\n{block['code']}") from e


def test_every_python_fence_is_a_test():
    # a fence the pattern misses (```py, ```python3) would silently go untested
    for page in PAGES:
        fences = re.findall(r"^```py.*$", page.read_text(), flags=re.MULTILINE)
        found = [f"```python{b['hf'] or ''}" for b in page_blocks(page)]
        assert fences == found, f"{page_name(page)}: fences {fences}, run as tests {found}"
    readme = page_blocks(ROOT / "README.md")
    assert sum(b["hf"] is None for b in readme) >= 2 and sum(b["hf"] is not None for b in readme) >= 2


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCED.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("Decoding (`experiments/bench_decode.py`)") == "decoding-experimentsbench_decodepy"
    assert slug("The zoo: other libraries' MoE blocks") == "the-zoo-other-libraries-moe-blocks"


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_relative_links_resolve(page: Path):
    text = FENCED.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page_name(page)}: broken links: {broken}"


def test_every_docs_page_is_in_the_map():
    index = (ROOT / "docs" / "index.md").read_text()
    missing = [p.name for p in PAGES[1:] if p.name != "index.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/index.md does not link {missing}"
