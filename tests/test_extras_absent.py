"""Without the optional extras, as after the quickstart install (the [dev] extra alone): the
package imports, ``backend="auto"`` runs the torch path, ``backend="triton"`` is refused in one
line naming the [triton] extra, ``moe-audit`` runs, and pytest names the extra of every test it
skips. Without even [dev]'s [train], [wandb] and [plot] (the core alone): every router, the
layer and the audit run, and the trainer says in one line which extra it needs. Each check runs Python in a subprocess with ``tests/hidden/sitecustomize.py`` first on
its path, which hides the modules named in $HIDDEN_MODULES (import fails, ``find_spec`` finds
nothing), so the extras installed here stay installed for everything else."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, SOURCE_PATH, SUBPROCESS_ENV, TRAIN_SCRIPT

HIDDEN = ROOT / "tests" / "hidden"


def run_without(modules: list[str], args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**SUBPROCESS_ENV, "PYTHONPATH": f"{HIDDEN}{os.pathsep}{SOURCE_PATH}", "HIDDEN_MODULES": ",".join(modules)}
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


LAYER_WITHOUT_TRITON = """
import importlib.util, sys
import torch
import moe
from causal_moe_kernels.reference import moe_ffn_reference
from causal_moe_kernels.torch_grouped import moe_ffn_grouped_mm
from moe.experts import resolve_backend

assert importlib.util.find_spec("triton") is None, "the hiding did not work"
assert resolve_backend("auto", torch.device("cuda")) is moe_ffn_grouped_mm  # a GPU needs no triton for auto
assert resolve_backend("auto", torch.device("cpu")) is moe_ffn_reference
auto = moe.MoELayer(d_model=16, d_ff=32, num_experts=4, router="topk", backend="auto").double()
plain = moe.MoELayer(d_model=16, d_ff=32, num_experts=4, router="topk", backend="torch").double()
plain.load_state_dict(auto.state_dict())
x = torch.randn(2, 8, 16, dtype=torch.float64)
assert torch.equal(auto(x), plain(x))
try:
    moe.MoELayer(d_model=16, d_ff=32, num_experts=4, backend="triton")
except ValueError as e:
    print(e)
assert "triton" not in sys.modules
"""


def test_without_triton_auto_runs_the_torch_path_and_triton_is_refused_in_one_line():
    proc = run_without(["triton"], ["-c", LAYER_WITHOUT_TRITON], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.strip()
    assert said.count("\n") == 0 and said.startswith("backend 'triton': ") and "[triton]" in said, said


def test_moe_audit_runs_without_triton(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(
        "import moe\n\n\ndef layer():\n"
        "    return moe.MoELayer(d_model=16, d_ff=32, num_experts=4, router='topk', backend='auto')\n"
    )
    proc = run_without(
        ["triton"], ["-m", "moe.audit", "--target", f"{target}:layer", "--input", "float:2,8,16", "--no-progress"], 300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


TRAINER_EXTRAS = ["tyro", "wandb", "matplotlib"]
"""The [train], [wandb] and [plot] extras: the core (pip install of the package alone) has none."""

CORE_WITHOUT_TRAINER_EXTRAS = """
import sys
import torch
import moe
from moe.audit.suite import ROUTER_CONFIGS

for name, options in ROUTER_CONFIGS:
    layer = moe.MoELayer(d_model=16, d_ff=32, num_experts=4, router=name, **options)
    y_BTD, routing = layer(torch.randn(2, 8, 16), return_routing=True)
    (y_BTD.square().mean() + routing.aux_loss).backward()
    moe.update_routers(layer)
import moe.audit.cli, moe.generation, moe.eval
print(sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN))
""".replace("HIDDEN", repr(TRAINER_EXTRAS))


def test_the_core_runs_every_router_and_imports_the_audit_without_the_trainer_extras():
    proc = run_without(TRAINER_EXTRAS, ["-c", CORE_WITHOUT_TRAINER_EXTRAS], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_trainer_without_tyro_says_which_extra_in_one_line():
    proc = run_without(["tyro"], [TRAIN_SCRIPT, "--steps", "1"], timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr[-3000:]
    assert proc.stderr == (
        "error: the trainer (moe.training, experiments/train.py) needs tyro, which is not installed: "
        "pip install 'causal-moe-routing[train]' (in a checkout: pip install -e '.[train]')\n"
    ), proc.stderr[-3000:]


@pytest.mark.slow
def test_moe_audit_builtin_suite_runs_without_triton():
    proc = run_without(["triton"], ["-m", "moe.audit", "--no-progress"], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_pytest_names_the_extra_of_every_test_it_skips():
    # test_readme_recipe.py needs tokenizers at import; test_kernels.py triton at import;
    # test_fused_experts.py has one triton-backed parameter among tests that run without it.
    files = ["tests/test_readme_recipe.py", "tests/test_kernels.py", "tests/test_fused_experts.py"]
    proc = run_without(["triton", "tokenizers"], ["-m", "pytest", "-q", "-p", "no:cacheprovider", *files], 300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert "[data]: 1 test module skipped; pip install -e '.[data]' runs them" in out, out[-3000:]
    assert "[triton]: 1 test module and 1 test skipped; pip install -e '.[triton]' runs them" in out, out[-3000:]
    assert "tests/test_readme_recipe.py:" in out and "tokenizers is not installed: the [data] extra" in out, out[-3000:]
