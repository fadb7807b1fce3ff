"""A target that cannot be audited in one mode is still audited in the other.

Found on outside code: astramind-ai/Mixture-of-depths moves a capacity schedule (plain
attributes) on every training call, so train mode is stateful, yet its eval forward picks the
top positions of the sequence and leaks; fastmoe's ``NoisyGate`` cannot run in eval mode (a
noise scale of 0 makes ``Normal.cdf`` reject its input) and is clean in training. Both were NOT
AUDITED as a whole, which hid the eval leak. Now the mode that cannot be audited says why, the
other is audited: a leak there is the verdict (exit 1); without one the verdict is NOT AUDITED in
that mode (exit 2), never clean.

Shapes: B=2, T=16, D=8.
"""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import CausalityError, assert_causal, audit, cli

B, T, D = 2, 16, 8


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


class ScheduledMixtureOfDepths(nn.Module):
    """Each sequence's top ``capacity`` share of positions by a router's score gets the block;
    every training call moves the capacity schedule (plain attributes, no buffers)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(D, generator=gen))
        self.block = nn.Parameter(torch.randn(D, D, generator=gen) / D**0.5)
        self.step, self.capacity = 0, 0.5

    def forward(self, x_BTD: Tensor) -> Tensor:
        if self.training:
            self.step += 1
            self.capacity = 0.25 + 0.5 / self.step
        score_BT = x_BTD @ self.router
        k = max(1, int(x_BTD.shape[1] * self.capacity))
        chosen_BT = torch.zeros_like(score_BT).scatter(1, score_BT.topk(k, dim=1).indices, 1.0)
        return x_BTD + chosen_BT[..., None] * torch.tanh(x_BTD @ self.block)


class TrainOnlyGate(nn.Module):
    """Per-token top-1 gating (causal) that raises in eval mode, as a noise scale of zero does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, D, D) / D**0.5)

    def forward(self, x_BTD: Tensor) -> Tensor:
        if not self.training:
            raise ValueError("Expected value argument to be within the support (Real())")
        expert_BT = self.gate(x_BTD).argmax(-1)
        return torch.einsum("btd,btde->bte", x_BTD, self.experts[expert_BT])


def test_a_mode_that_is_stateful_leaves_the_other_audited():
    report = audit(ScheduledMixtureOfDepths(), example())
    assert report.error is None and list(report.modes_not_audited) == ["train"], report.summary()
    assert (
        "the target is stateful (its forward changes capacity, step outside its buffers)"
        in (report.modes_not_audited["train"])
    ), report.modes_not_audited
    assert report.leaks_in == ["eval"] and report.verdict == "LEAKS", report.summary()
    assert {p.mode for p in report.probes} == {"eval"}
    assert report.summary().startswith("ScheduledMixtureOfDepths: LEAKS in eval mode"), report.summary()
    assert cli.exit_code([report], user_target=True) == 1


def test_a_mode_that_fails_leaves_no_clean_verdict():
    report = audit(TrainOnlyGate(), example())
    assert report.error is None and report.audited_modes == ["train"], report.summary()
    assert report.modes_not_audited["eval"].startswith("the target failed on the example in eval mode")
    assert not report.leaks and report.verdict == "NOT AUDITED in eval mode", report.summary()
    assert "no leak found in train mode; NOT AUDITED in eval mode" in report.summary(), report.summary()
    assert cli.exit_code([report], user_target=True) == 2
    try:
        assert_causal(TrainOnlyGate(), example())
    except CausalityError as e:
        assert "NOT AUDITED in eval mode: the target failed on the example" in str(e), str(e)
    else:
        raise AssertionError("assert_causal passed a target it could not audit in eval mode")
    assert assert_causal(TrainOnlyGate(), example(), modes=("train",)).verdict == "clean"


def test_the_command_prints_the_audited_mode_and_one_line_for_the_other(tmp_path, capsys):
    (tmp_path / "t.py").write_text(
        "from test_audit_partial_modes import ScheduledMixtureOfDepths\n"
        "def build():\n"
        "    return ScheduledMixtureOfDepths()\n"
    )
    assert cli.main(["--target", f"{tmp_path / 't.py'}:build", "--input", f"float:{B},{T},{D}", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("build: LEAKS in eval mode"), captured.out
    assert "  train mode: NOT AUDITED: two identical calls differ" in captured.out, captured.out
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("moe-audit: error: build: NOT AUDITED in train mode: two identical calls differ"), line
