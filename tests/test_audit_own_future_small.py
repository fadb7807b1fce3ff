"""The own-future check counts a sample as moved at the mode's tolerance, as every probe judges:
a target whose own leak moves its outputs by only a few times the tolerance (float64, 3e-14 of
the next position, beside a batch mean) is still found moved by its own future alone."""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)

from moe.audit import audit


def faint_next_position_and_batch_mean(x_BTD: torch.Tensor) -> torch.Tensor:
    nxt = torch.cat([x_BTD[:, 1:], torch.zeros_like(x_BTD[:, :1])], 1)
    return x_BTD + 3e-14 * nxt + x_BTD.mean(0, keepdim=True)


def test_a_faint_own_leak_is_counted_at_the_tolerance():
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    report = audit(faint_next_position_and_batch_mean, x, modes=("eval",))
    assert report.leaks_in == ["eval"] and not report.batch_invariant, report.summary()
    counts = report.own_future["eval"]
    assert counts["moved"] >= 3 and counts["own_alone"] == counts["moved"], counts
