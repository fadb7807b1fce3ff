"""The audit's sampler of fresh float positions draws N(mean, std) of the example, with std 1
where the example has no spread (a constant example would otherwise give futures equal to its
own values, which perturb nothing)."""

from __future__ import annotations

import math

import torch

from moe.audit.probes import Sampler


def test_a_constant_example_is_resampled_with_unit_spread():
    sampler = Sampler(torch.full((2, 4, 3), 0.5), vocab_size=None)
    assert (sampler.mean, sampler.std) == (0.5, 1.0)
    z = sampler.draw((4000,), torch.Generator().manual_seed(0)).double()
    assert abs(float(z.mean()) - 0.5) < 0.1 and abs(float(z.std()) - 1.0) < 0.05


def test_an_example_is_resampled_with_its_own_mean_and_spread():
    x = torch.tensor([[[1.0], [3.0], [5.0], [7.0]]])
    sampler = Sampler(x, vocab_size=None)
    assert sampler.mean == 4.0 and abs(sampler.std - math.sqrt(20 / 3)) < 1e-12  # the sample std of 1, 3, 5, 7
