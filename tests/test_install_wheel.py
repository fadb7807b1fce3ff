"""The wheel pip builds from this tree (``pip wheel . --no-deps``): the names it installs, and
what it does installed non-editable in a fresh environment, as a user of the index gets it.

The wheel is built from a copy of the files it is made of (a build in the checkout would leave
``build/`` there, whose stale files from an older layout setuptools would pack too). Building
takes pip's isolated build environment (setuptools from the package index): ``slow``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from helpers import ROOT
from test_install import index_unreachable

OURS = {"moe", "causal_moe_kernels"}
"""Our top-level import names: moe/ at the root, the kernels' package under kernels/."""
DISTRIBUTION = "causal-moe-routing"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    reason = index_unreachable()
    if reason is not None:
        pytest.skip(reason)
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for folder in ("moe", "kernels"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def top_level_names(wheel_files: list[str]) -> set[str]:
    """The import names a wheel installs: its top-level folders and modules, not its metadata."""
    tops = {name.split("/")[0] for name in wheel_files}
    return {t.removesuffix(".py") for t in tops if not t.endswith((".dist-info", ".data"))}


@pytest.mark.slow
def test_the_wheel_installs_only_our_names_and_none_another_distribution_owns(wheel):
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
        (top_level_txt,) = [n for n in files if n.endswith(".dist-info/top_level.txt")]
        declared = set(z.read(top_level_txt).decode().split())
    assert top_level_names(files) == OURS, sorted(top_level_names(files))
    assert declared == OURS, declared
    owners = {name: set(packages_distributions().get(name, ())) - {DISTRIBUTION} for name in OURS}
    assert not any(owners.values()), f"installed distributions own our import names: {owners}"
    assert any(f.startswith("causal_moe_kernels/") and f.endswith("/reference.py") for f in files), files


def test_a_missing_kernel_attribute_names_our_package():
    import causal_moe_kernels

    with pytest.raises(AttributeError, match="^module 'causal_moe_kernels' has no attribute 'nope'$"):
        causal_moe_kernels.nope  # noqa: B018
