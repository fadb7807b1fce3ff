"""``OptimizerConfig`` at the ends of its ranges: ``min_lr_ratio`` 1 (no decay: a constant rate
after warmup) and 0 are taken, beyond them refused; the schedule worked by hand."""

from __future__ import annotations

import pytest

from moe.training.optim import OptimizerConfig, lr_at


def test_min_lr_ratio_takes_both_ends_of_its_range():
    flat = OptimizerConfig(steps=10, lr=0.5, min_lr_ratio=1.0, warmup_steps=2)
    assert [lr_at(s, flat) for s in range(12)] == [0.25] + [0.5] * 11
    zero = OptimizerConfig(steps=10, lr=0.5, min_lr_ratio=0.0, warmup_steps=0)
    assert lr_at(0, zero) == 0.5 and lr_at(9, zero) == 0.0
    for bad in (1.0001, -0.1):
        with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\]"):
            OptimizerConfig(min_lr_ratio=bad)
