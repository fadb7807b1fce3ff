"""The own-future check resamples a sample's whole future, from the first position after the
cut: a target whose own leak reads only the next position (``x[b, t + 1]``), beside a mean over
the batch at the same position (not batch-invariant, but no future through other samples), is
moved by its own future alone every time."""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)

from moe.audit import audit


def next_position_and_batch_mean(x_BTD: torch.Tensor) -> torch.Tensor:
    nxt = torch.cat([x_BTD[:, 1:], torch.zeros_like(x_BTD[:, :1])], 1)
    return nxt + x_BTD.mean(0, keepdim=True)


def test_a_leak_through_the_next_position_is_found_in_the_samples_own_future():
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    report = audit(next_position_and_batch_mean, x, modes=("eval",))
    assert report.leaks_in == ["eval"] and not report.batch_invariant, report.summary()
    counts = report.own_future["eval"]
    assert counts["moved"] >= 3 and counts["own_alone"] == counts["moved"], counts
    assert report.across_samples_in == []
