"""The inputs calibration uses to check that a stochastic target draws the same noise shapes
for other data: the example with every position after the first resampled (position 0 kept),
for float features and token ids alike."""

from __future__ import annotations

import torch

from moe.audit.probes import Sampler, calibration_inputs


def test_every_position_after_the_first_is_resampled():
    floats = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(17))
    for x, vocab in ((floats, None), (torch.zeros(2, 5, dtype=torch.int64), 1000)):
        inputs = calibration_inputs(x, Sampler(x, vocab), seed=0, n=3)
        assert len(inputs) == 3
        for v in inputs:
            assert v.shape == x.shape and v.dtype == x.dtype
            assert torch.equal(v[:, 0], x[:, 0])
            moved = v[:, 1:] != x[:, 1:]
            assert bool((moved.any(-1) if x.is_floating_point() else moved).all())  # ids of 1000: none 0 here
