"""Targets that draw from Python's ``random`` or NumPy's global generator (StableMoE's greedy
balanced assignment shuffles its experts with ``np.random.shuffle``): the runner seeds both
before every forward, and now also sees that they drew, so such a target is seeded (compared
exactly at the example's shape, by distribution across shapes) or, where the number of its draws
follows the data, judged by distribution, as a target drawing from torch is. On a84d900 no
recording listed these draws: the target was "deterministic" and its prefixes and a later sample
alone, whose noise sits elsewhere in the stream, read as decode-inconsistent and batch-dependent.

Shapes: x [2, 16, 16]."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit


class HostNoise(nn.Module):
    """x + unit noise per entry drawn from NumPy's or Python's generator: causal, batch-invariant
    and decode-consistent in law."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def forward(self, x_BTD: Tensor) -> Tensor:
        if self.source == "numpy":
            noise = np.random.randn(*x_BTD.shape)
        else:
            noise = np.array([random.gauss(0.0, 1.0) for _ in range(x_BTD.numel())]).reshape(x_BTD.shape)
        return x_BTD + torch.from_numpy(noise).to(x_BTD.dtype)


class DataLengthNoise(nn.Module):
    """x + NumPy noise taken from the end of a draw whose length counts the positive entries of
    the first feature: the same seed gives other noise for other content, so it can only be
    judged by distribution."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        extra = int((x_BTD[..., 0] > 0).sum())
        noise = np.random.randn(extra + x_BTD.numel())[extra:].reshape(x_BTD.shape)
        return x_BTD + torch.from_numpy(noise).to(x_BTD.dtype)


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_noise_from_a_host_generator_is_seeded_not_a_batch_or_decode_finding(source):
    report = audit(HostNoise(source), example(), modes=("eval",))
    assert report.regimes == {"eval": "seeded"}, report.table()
    assert not report.leaks and report.batch_invariant and report.decode_consistent, report.table()


def test_host_draws_whose_number_follows_the_data_are_judged_by_distribution():
    report = audit(DataLengthNoise(), example(), modes=("eval",))
    assert report.regimes == {"eval": "distribution"} and not report.leaks, report.table()
