"""A leak with no gradient path is not always a choice of tokens: a statistic of the sequence
computed under ``torch.no_grad()`` (normalising by a detached mean) moves earlier outputs
smoothly. Where the forward probes find a leak the Jacobian does not read, the audit walks a
straight path of inputs to another future: jumps mean a discrete change (the routing advice),
smooth moves a detached statistic (its own advice, no router named)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.audit import audit


class DetachedMean(nn.Module):
    """W (x - mean over the sequence), the mean taken without gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            mu = x.mean(dim=1, keepdim=True)
        return self.lin(x - mu)


class TopHalf(nn.Module):
    """W x at the positions whose first feature ranks in the top half of the sequence, 0 elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        rank = x[..., 0].argsort(1).argsort(1)
        return self.lin(x) * (rank >= x.shape[1] // 2).unsqueeze(-1)


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


def test_a_statistic_taken_without_gradient_is_named_as_such_not_as_routing():
    report = audit(DetachedMean(), example(), modes=("eval",))
    jacobian = report.probe("jacobian", "eval")
    assert report.leaks and not jacobian.leaks
    assert jacobian.smooth_positions == list(range(8)) and jacobian.jump_positions == []  # the path resamples 8..15
    summary = report.summary()
    assert "a statistic of later positions computed without gradient" in summary, summary
    assert "which tokens are served" not in summary and "in your own block" not in summary


def test_a_choice_of_positions_with_no_gradient_keeps_the_discrete_advice():
    """A choice, not a statistic; nothing in TopHalf is named as routing, so no router is advised."""
    report = audit(TopHalf(), example(), modes=("eval",))
    jacobian = report.probe("jacobian", "eval")
    assert report.leaks and not jacobian.leaks and jacobian.jump_positions
    summary = report.summary()
    assert "a discrete change: which outputs change depends on later tokens (no gradient path" in summary
    assert "no router is advised" in summary, summary
    assert "computed without gradient" not in summary


class MeanAndFlood(nn.Module):
    """Positions >= 1 add the mean of the whole sequence (a gradient to later inputs); position 0
    adds a function of S, the mean squared feature over the later positions (about 1 for random
    futures, about 9 for x3 copies): 0.01 relu(S - 2)^2, smooth with no gradient at the example
    (as zoology's Nystrom attention reads the future at position 0, by a gradient of 6e-9), or
    ``step``: 0.1 (S > 2), a choice."""

    def __init__(self, step: bool) -> None:
        super().__init__()
        self.step = step

    def forward(self, x: Tensor) -> Tensor:
        s = (x[:, 1:] ** 2).mean((1, 2))
        flood = 0.1 * (s > 2).to(x.dtype) if self.step else 0.01 * torch.relu(s - 2) ** 2
        first = x[:, :1] + flood[:, None, None]
        return torch.cat([first, x[:, 1:] + x.mean(1, keepdim=True)], 1)


def test_a_position_moved_smoothly_without_gradient_beside_a_gradient_leak_is_no_choice():
    report = audit(MeanAndFlood(step=False), example(), modes=("eval",))
    jacobian = report.probe("jacobian", "eval")
    assert 0 not in jacobian.leaking_positions and 0 in report.probe("adversarial_future", "eval").leaking_positions
    assert jacobian.smooth_positions == [0] and jacobian.jump_positions == [], report.table()
    summary = report.summary()
    assert "reads later inputs through a differentiable path" in summary, summary
    assert "discrete" not in summary and "a choice over the sequence" not in summary, summary


def test_a_choice_at_a_position_without_gradient_beside_a_gradient_leak_keeps_the_discrete_advice():
    report = audit(MeanAndFlood(step=True), example(), modes=("eval",))
    jacobian = report.probe("jacobian", "eval")
    assert 0 in jacobian.jump_positions and 0 not in jacobian.smooth_positions, report.table()
    summary = report.summary()
    assert "outputs at positions 0 also moved where that gradient is zero or jumped" in summary, summary


class SaturatingScale(DetachedMean):
    """W x times 1 + min(m, m_past / 2 + 0.01), m the mean |x| over the whole sequence and m_past
    over positions 0-7, both without gradient: at an example whose positions 8-15 are zero, m is
    m_past / 2, and on a straight path to a random future it rises in proportion and saturates
    within the path's first step. Continuous, with a kink (the slope falls to zero), as
    performer-pytorch's causal softmax kernel, whose keys are stabilised by a detached maximum over
    the whole sequence: the path's own halving of its steps reads it as a jump, further halvings
    do not."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            m = x.abs().mean((1, 2))
            cap = x[:, :8].abs().mean((1, 2)) / 2 + 0.01
            scale = 1 + torch.minimum(m, cap)
        return self.lin(x) * scale[:, None, None]


def test_a_detached_statistic_that_saturates_within_a_step_is_no_jump():
    x = example()
    x[:, 8:] = 0.0
    report = audit(SaturatingScale(), x, modes=("eval",))
    jacobian = report.probe("jacobian", "eval")
    assert report.leaks and not jacobian.leaks
    assert jacobian.jump_positions == [] and jacobian.smooth_positions == list(range(8)), report.table()
    summary = report.summary()
    assert "a statistic of later positions computed without gradient" in summary, summary
    assert "a discrete change" not in summary, summary
