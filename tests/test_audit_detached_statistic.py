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
