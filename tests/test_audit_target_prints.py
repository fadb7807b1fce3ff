"""What a target prints (a warning at import, a line per forward: theAdamColton/diffmoe's eval
forward printed "Warning! unable to dynamically pad" 123 times into an audit) goes to stderr:
``moe-audit``'s stdout is its report alone, which scripts read."""

from __future__ import annotations

from moe.audit import cli

TARGET = """
import torch
from torch import nn

print("imported: a message of the target's own")


class Chatty(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        print("a forward of the target")
        return self.lin(x)


chatty = Chatty
"""


def test_what_a_target_prints_goes_to_stderr_and_stdout_is_the_report(tmp_path, capsys):
    (tmp_path / "chatty.py").write_text(TARGET)
    code = cli.main(["--target", f"{tmp_path / 'chatty.py'}:chatty", "--input", "float:2,8,8", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.startswith("chatty: no leak found") and "a forward of the target" not in out and "imported:" not in out
    assert "imported: a message of the target's own" in err and err.count("a forward of the target") > 50
