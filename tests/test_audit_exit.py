"""A target that calls ``sys.exit`` is never read as a verdict. On 7dc4c10 ``moe-audit`` on a file
that calls ``sys.exit(0)`` at import exited 0 with no output (a CI check reads that as "no
leak"), and ``sys.exit(1)`` exited 1 (read as "a leak"); the docs promise exit 2 for a target that
cannot be loaded. Shapes: B=4, T=16, D=8.
"""

from __future__ import annotations

import pytest

from moe.audit import cli

BLOCK = "import torch\nfrom torch import nn\n\n"


def _run(tmp_path, capsys, source: str, name: str = "block") -> tuple[int, str, str]:
    file = tmp_path / "target.py"
    file.write_text(source)
    code = cli.main(["--target", f"{file}:{name}", "--input", "float:4,16,8", "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("status", [0, 1])
def test_sys_exit_at_import_is_exit_2_with_one_line(tmp_path, capsys, status):
    code, out, err = _run(tmp_path, capsys, f"import sys\n{BLOCK}sys.exit({status})\nblock = nn.Identity()\n")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert f"the target could not be loaded: it called sys.exit({status})" in err, err


def test_sys_exit_in_the_factory_is_exit_2(tmp_path, capsys):
    code, out, err = _run(tmp_path, capsys, f"import sys\n{BLOCK}def build():\n    sys.exit(0)\n", name="build")
    assert code == 2 and out == "" and "the target could not be loaded: build()" in err and "sys.exit(0)" in err, err


def test_sys_exit_in_a_forward_is_exit_2(tmp_path, capsys):
    """Only on some inputs (a value above 3 in the last position): the audit stops at once."""
    source = (
        f"import sys\n{BLOCK}class Block(nn.Module):\n"
        "    def forward(self, x):\n"
        "        if bool((x[:, -1] > 3).any()):\n"
        "            sys.exit(0)\n"
        "        return x * 2\n\nblock = Block()\n"
    )
    code, out, err = _run(tmp_path, capsys, source)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert "the target could not be run: it called sys.exit(0) in a forward on an input of shape" in err, err
