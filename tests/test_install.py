"""Every install the pages tell a user to run works with plain pip: each ``pip install`` command
of README.md and docs/*.md resolves in a fresh environment, and every extra of pyproject.toml
is in one of them.

The resolution is pip's own (``pip install --dry-run --ignore-installed``: nothing installed
here counts, nothing is installed), against the package index, so those tests need the
registry: they are ``slow`` (.ci/run runs them; 15-45 s each), and skipped, saying why, where
the index does not answer. torch is held at the version installed here, as the README has a
user install theirs first (an unpinned one would resolve the multi-GB CUDA build).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import urllib.request
from functools import cache

import pytest
import torch
from helpers import ROOT
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: the tomli backport, a requirement there
    import tomli as tomllib

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PIP_INSTALL = re.compile(r"(?P<env>(?:[A-Z_]+=\S+ )*)pip install (?P<args>[^`\n#&]+)")
EXTRAS = re.compile(r"\.\[([\w,-]+)\]")


def page_installs() -> dict[str, tuple[dict, list[str]]]:
    """Each distinct ``pip install`` command of the pages: its text -> (environment, arguments)."""
    found = {}
    for page in PAGES:
        for m in PIP_INSTALL.finditer(page.read_text()):
            env = dict(pair.split("=", 1) for pair in m["env"].split())
            found[m[0].strip()] = (env, shlex.split(m["args"]))
    return found


def project_extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_pages_name_only_extras_that_exist_and_every_extra_is_on_a_page():
    named = {
        extra
        for _, args in page_installs().values()
        for a in args
        for m in EXTRAS.finditer(a)
        for extra in m[1].split(",")
    }
    assert named, "no pip install -e '.[extra]' found on the pages: the pattern is stale"
    assert named <= set(project_extras()), (
        f"pages name extras pyproject.toml lacks: {sorted(named - set(project_extras()))}"
    )
    assert set(project_extras()) <= named, (
        f"extras no page tells how to install: {sorted(set(project_extras()) - named)}"
    )


@cache
def index_unreachable() -> str | None:
    """Why the package index cannot be asked, or None when it answers."""
    if Version(__import__("pip").__version__) < Version("22.2"):
        return "pip install --dry-run needs pip >= 22.2"
    index = os.environ.get("PIP_INDEX_URL")
    if index is None:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
        )
        index = got.stdout.strip() if got.returncode == 0 and got.stdout.strip() else "https://pypi.org/simple"
    try:
        urllib.request.urlopen(f"{index.rstrip('/')}/pip/", timeout=15).close()
    except OSError as e:
        return f"the package index {index} does not answer ({e}): the install checks need it"
    return None


def resolve(args: list[str], env: dict, tmp_path) -> subprocess.CompletedProcess:
    """pip's resolution of ``pip install ARGS`` in a fresh environment, torch held at the installed version."""
    reason = index_unreachable()
    if reason is not None:
        pytest.skip(reason)
    constraints = tmp_path / "torch.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    held = [] if any(a.startswith("torch") for a in args) else ["-c", str(constraints)]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", *held, *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(page_installs()))
def test_every_install_command_of_the_pages_resolves(command, tmp_path):
    env, args = page_installs()[command]
    proc = resolve(args, env, tmp_path)
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or "conflict" in line]
    assert proc.returncode == 0, f"{command!r} does not install:\n" + "\n".join(
        errors or proc.stderr.splitlines()[-20:]
    )
