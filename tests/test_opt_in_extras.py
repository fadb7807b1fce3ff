"""wandb is opt-in, and a missing optional extra is one line naming it (``moe.extras``).

A run with no folder of its own writes no ``./wandb/`` into the working directory; a mode asked
for is honoured; without wandb installed an unasked run logs none and an asked one is refused
in one line. A module is made "not installed" in-process by ``sys.modules[name] = None``, which
``importlib`` treats as absent (tests/test_extras_absent.py hides whole extras in a subprocess).
"""

from __future__ import annotations

import sys

import pytest
from helpers import SMALL_RUN

from moe.extras import MissingExtra, pyplot, require
from moe.training import TrainConfig, main, train
from moe.training.metrics import resolve_wandb_mode


@pytest.fixture
def unasked(monkeypatch):
    """No mode asked for, no key: wandb's default applies."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return monkeypatch


def test_an_unasked_run_with_no_folder_writes_no_wandb_into_the_working_directory(tmp_path, unasked):
    unasked.chdir(tmp_path)
    train(TrainConfig.flat(steps=1, **SMALL_RUN))
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_the_default_mode_is_disabled_without_a_folder_or_without_wandb(tmp_path, unasked):
    assert resolve_wandb_mode(None, None) == "disabled"
    assert resolve_wandb_mode(None, str(tmp_path)) == "offline"
    assert resolve_wandb_mode("offline", None) == "offline"  # asked for: honoured, in the working directory
    unasked.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode(None, str(tmp_path)) == "online"
    unasked.setitem(sys.modules, "wandb", None)
    assert resolve_wandb_mode(None, str(tmp_path)) == "disabled"
    unasked.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode(None, str(tmp_path)) == "offline"


def test_wandb_asked_for_but_not_installed_is_one_line_naming_the_extra(tmp_path, unasked, capsys):
    unasked.setitem(sys.modules, "wandb", None)
    args = ["--steps", "1", "--seq-len", "16", "--batch-size", "2", "--max-bytes", "20000", "--no-progress"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--d-model", "32", "--moe-d-ff", "32", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --wandb-mode offline needs wandb, which is not installed: pip install 'causal-moe-routing[wandb]' "
        "(in a checkout: pip install -e '.[wandb]')"
    ), err
    unasked.setenv("WANDB_MODE", "online")
    with pytest.raises(SystemExit):
        main([*args, "--d-model", "32", "--moe-d-ff", "32", "--wandb-dir", str(tmp_path)])
    assert capsys.readouterr().err.startswith("error: $WANDB_MODE online needs wandb, which is not installed")


def test_require_names_the_extra_and_keeps_other_import_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"^the figure needs matplotlib, which is not installed: .*\[plot\]") as e:
        pyplot("the figure")
    assert isinstance(e.value, ImportError) and e.value.name == "matplotlib"
    with pytest.raises(ModuleNotFoundError) as e:  # a module the package itself lacks is not the extra's fault
        require("moe.no_such_module", "train", "a test")
    assert not isinstance(e.value, MissingExtra)
