"""What the audit's report says: advice by the mechanism found, the reason beside a large change
it did not count, where a target raised, probes it skipped, and the command's lines (a
NOT AUDITED target once, on stderr; a progress line per probe on long audits, never in JSON).

Shapes: B=4, T=16, D=16 (32 for the built-in routers), E=4.
"""

from __future__ import annotations

import inspect
import json
import math
import textwrap

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit, cli
from moe.routers import build_router

B, T, D, E = 4, 16, 16, 4
GROUPS = 8
"""The grouped target cuts the flattened batch into this many groups."""


def example(seed: int = 0, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


class GroupedExpertChoice(nn.Module):
    """Expert choice inside GROUPS groups of the flattened batch (group size B * T / GROUPS),
    with a multiplicative routing jitter in training. In a full batch each group holds positions
    of one sample; a sample run alone is cut into groups 4x smaller, with less capacity each, so
    it routes differently, and the jitter makes that comparison one by distribution."""

    def __init__(self, jitter: float = 0.1) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, D, generator=torch.Generator().manual_seed(0)))
        self.jitter = jitter

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_GND = x_BTD.reshape(GROUPS, -1, d)
        if self.training:
            x_GND = x_GND * (1 + self.jitter * (2 * torch.rand_like(x_GND) - 1))
        p_GNE = (x_GND @ self.gate.T).softmax(-1)
        top_GCE = p_GNE.topk(max(1, x_GND.shape[1] // E), dim=1).indices
        w_GNE = torch.zeros_like(p_GNE).scatter(1, top_GCE, p_GNE.gather(1, top_GCE))
        return w_GNE.reshape(b, t, E)


def test_a_large_change_beside_batch_invariant_yes_says_why():
    report = audit(GroupedExpertChoice(), example(), modes=("train",), name="grouped")
    batch = report.probe("batch_interference", "train")
    line = next(s for s in report.summary().splitlines() if s.startswith("  batch-invariant:"))
    # Sample 0 alone moved by ~0.66, judged by distribution (the jitter): p = 4e-4 over 8 seeds, just
    # above the level of one comparison, so "yes", and the line says which change and why not counted.
    assert report.batch_invariant and batch.max_abs_delta > 0.5 and batch.largest_change_p > 2e-4, report.table()
    assert line.startswith("  batch-invariant: yes; not counted: batch_interference (train)"), line
    assert f"changed outputs by up to {batch.max_abs_delta:.3g} (sample 0 alone), not significant" in line, line
    assert f"p = {batch.largest_change_p:.0e}, above the level 2e-04 of one comparison" in line, line


class MixtureOfDepths(nn.Module):
    """A Mixture-of-Depths block (each sequence's top T / 2 positions by a router's score get the
    block, the rest skip it): expert choice over positions, opaque to the audit."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(D, generator=gen))
        self.block = nn.Parameter(torch.randn(D, D, generator=gen) / math.sqrt(D))

    def forward(self, x_BTD: Tensor) -> Tensor:
        score_BT = x_BTD @ self.router
        chosen_BT = torch.zeros_like(score_BT, dtype=torch.bool)
        chosen_BT.scatter_(1, score_BT.topk(x_BTD.shape[1] // 2, dim=1).indices, True)
        update_BTD = torch.sigmoid(score_BT)[..., None] * torch.tanh(x_BTD @ self.block)
        return x_BTD + update_BTD * chosen_BT[..., None]


class RollInTime(nn.Module):
    """Reads the next position (a torch.roll over time): a look-ahead that is not a router."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        return x_BTD + 0.5 * torch.roll(x_BTD, -1, dims=1)


def _router(name: str, **options) -> nn.Module:
    torch.manual_seed(0)
    return build_router(name, d_model=32, num_experts=E, capacity_factor=1.0, **options)


def test_advice_follows_the_mechanism():
    ec = audit(_router("expert_choice"), example(d=32), modes=("eval",)).summary()
    assert "mechanism: expert choice over positions" in ec and "use ec_threshold or ec_predictor" in ec, ec
    assert "capacity_scope" not in ec and 'moe.MoELayer(d_model, d_ff, num_experts, router="ec_threshold")' in ec
    score = audit(_router("capacity", priority="score"), example(d=32), modes=("eval",)).summary()
    assert "mechanism: capacity kept by score" in score and 'capacity_scope="prefix"' in score, score
    assert "ec_threshold" not in score, score
    roll = audit(RollInTime(), example(), modes=("eval",)).summary()
    assert "through a differentiable path" in roll and "not a routing decision" in roll, roll
    assert "MoELayer" not in roll and "ec_threshold" not in roll, roll
    # Opaque expert choice over positions: the audit cannot see how it routes, so both remedies,
    # each with its condition, and how to put either into the user's block.
    mod = audit(MixtureOfDepths(), example(), modes=("eval",)).summary()
    assert "the audit cannot tell how it is routed" in mod and "If experts or a block pick their top positions" in mod
    assert 'router="ec_threshold")' in mod and 'capacity_scope="prefix")' in mod, mod


def _raises(x: Tensor) -> Tensor:
    raise RuntimeError("kaboom")


def _integer_output(x: Tensor) -> Tensor:
    return (x[..., :1] > 0).long().cumsum(dim=1)  # a prefix count: causal, integer


def test_a_raise_is_reported_with_its_file_and_line():
    line = inspect.getsourcelines(_raises)[1] + 1
    report = audit(_raises, example())
    assert report.error.endswith(f"RuntimeError: kaboom (raised at {__file__}:{line}))"), report.error


def test_an_integer_output_says_which_probe_it_skips_and_why():
    report = audit(_integer_output, example(), modes=("eval",))
    assert report.error is None and report.leaks_in == [], report.summary()
    jac = report.probe("jacobian", "eval")
    assert not jac.ran and jac.skipped == "the output is integer or bool: it has no gradient to read"
    assert "jacobian/eval did not run: the output is integer or bool" in report.summary()
    assert "jacobian/eval did not run: the output is integer or bool" in report.table()


TARGETS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaboom")


    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)


    broken, causal = Broken(), Causal()
    """
)


def test_not_audited_is_one_line_on_stderr_even_verbose(tmp_path, capsys):
    (tmp_path / "t.py").write_text(TARGETS)
    argv = ["--target", f"{tmp_path / 't.py'}:broken", "--input", "float:4,16,8", "--no-progress", "--verbose"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # no table, no "batch-invariant: yes" over an audit that did not run
    assert captured.err.count("NOT AUDITED") == 1 and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("moe-audit: error: broken: NOT AUDITED: the target failed on the example")


def test_progress_lines_per_probe_on_stderr_not_in_json(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.py").write_text(TARGETS)
    monkeypatch.setattr(cli, "LONG_AUDIT_S", 0.0)  # every audit counts as long
    out_json = tmp_path / "a.json"
    argv = ["--target", f"{tmp_path / 't.py'}:causal", "--input", "float:4,16,8", "--json", str(out_json)]
    assert cli.main([*argv, "--modes", "eval", "--trials", "1"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    probes = ("random_future", "adversarial_future", "jacobian", "batch_interference", "decode_consistency")
    assert len(lines) == len(probes), captured.err
    assert all(line.startswith("moe-audit: causal: ") and " (eval): nothing found in " in line for line in lines)
    assert {line.split(": ")[2].split(" ")[0] for line in lines} == set(probes), captured.err
    assert "so far" not in out_json.read_text() and "so far" not in captured.out
    assert json.loads(out_json.read_text())["targets"][0]["leaks"] is False
    monkeypatch.setattr(cli, "LONG_AUDIT_S", 1e9)
    assert cli.main([*argv, "--modes", "eval", "--trials", "1"]) == 0
    assert capsys.readouterr().err == "", "a quick audit prints no progress"
