"""The audit's tolerances pinned by leaks of known size, and positive controls that a slip in
the comparison (an off-by-one cut, a looser tolerance) would let through.

Targets here are the identity plus a planted leak into position 0 whose size is a stated
multiple of the (relative) tolerance the audit should use, so a tolerance 10x looser misses it.
Shapes: B=4, T=16, D=8.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor, nn

from moe.audit import audit

B, T, D = 4, 16, 8
SEEDS = range(5)
ULPS = {torch.float32: 100, torch.bfloat16: 4}
"""The audit's least tolerance in ulps of the output scale (its documented values)."""


def example(seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


class StepLeak(nn.Module):
    """y = x, and y[:, 0] *= 1 + rel when the last position's first feature is positive: a jump of
    exactly ``rel`` times each entry of position 0 (no gradient, so only forward comparisons see
    it). The audit's tolerance is relative to each entry's scale, so a relative leak pins it."""

    def __init__(self, rel: float) -> None:
        super().__init__()
        self.rel = rel

    def forward(self, x: Tensor) -> Tensor:
        y = x.float().clone()
        y[:, 0] *= 1 + self.rel * (x[:, -1, :1] > 0).float()
        return y.to(x.dtype)


_CALLS = itertools.count()
"""A call counter outside every target: noise from it stands for a nondeterministic kernel (the
audit cannot reset it, and no attribute of the target changes)."""


class AlternatingNoise(StepLeak):
    """StepLeak times 1 + ``noise`` on every other call: a relative noise floor of ``noise``."""

    def __init__(self, rel: float, noise: float) -> None:
        super().__init__(rel)
        self.noise = noise

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * (1 + self.noise * (next(_CALLS) % 2))


def _scale(x: Tensor) -> float:
    return float(x.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_least_tolerance_is_pinned_by_a_leak_5x_above_it(dtype):
    """The tolerance is exactly ULPS ulps of each entry: a leak of 5x that is found, one of 0.5x
    (a tolerance 10x tighter would count it) is not."""
    resolution = ULPS[dtype] * torch.finfo(dtype).eps
    for seed in SEEDS:
        x = example(seed, dtype)
        leaky = audit(StepLeak(5 * resolution), x, seed=seed, modes=("eval",))
        assert leaky.leaks_in == ["eval"], f"a leak of 5x the {dtype} tolerance must be found\n{leaky.table()}"
        tol = leaky.probe("random_future", "eval").tolerance
        assert tol == pytest.approx(resolution), f"tolerance {tol:.3e}, expected {resolution:.3e}"
        below = audit(StepLeak(0.5 * resolution), x, seed=seed, modes=("eval",))
        assert below.leaks_in == [], f"a change of half the tolerance must not count\n{below.table()}"
        clean = audit(StepLeak(0.0), x, seed=seed, modes=("eval",))
        assert clean.leaks_in == [], clean.table()


def test_noise_floor_factor_is_pinned():
    """A relative floor of 0.5 resolution gives a tolerance of 5 resolutions (10x the floor); a
    leak of 20 resolutions is found; with the factor 10x larger (100x the floor) it would be missed."""
    resolution = ULPS[torch.float32] * torch.finfo(torch.float32).eps
    for seed in SEEDS:
        x = example(seed)
        report = audit(AlternatingNoise(20 * resolution, 0.5 * resolution), x, seed=seed, modes=("eval",))
        assert report.regimes == {"eval": "deterministic"}, report.table()
        tol = report.probe("random_future", "eval").tolerance
        assert tol == pytest.approx(5 * resolution, rel=0.05), f"tolerance {tol:.3e}, expected {5 * resolution:.3e}"
        assert report.leaks_in == ["eval"], report.table()


class ContinuousLeak(nn.Module):
    """y = x + rel * scale * tanh(x[:, -1]) at every position: a smooth leak of relative size
    about ``rel`` of the output scale (tanh's changes are O(1))."""

    def __init__(self, rel: float, scale: float) -> None:
        super().__init__()
        self.amount = rel * scale

    def forward(self, x: Tensor) -> Tensor:
        return x + self.amount * torch.tanh(x[:, -1:])


def test_random_future_flags_a_1e4_relative_continuous_leak():
    for seed in SEEDS:
        x = example(seed)
        report = audit(ContinuousLeak(1e-4, _scale(x)), x, seed=seed)
        for mode in ("train", "eval"):
            p = report.probe("random_future", mode)
            assert p.leaks and p.max_abs_delta > 1e-5 * _scale(x), report.table()


class OneStepAhead(nn.Module):
    """y[:, t] = x[:, t + 1] (the last position reads nothing): the smallest future leak."""

    def forward(self, x: Tensor) -> Tensor:
        y = torch.zeros_like(x)
        y[:, :-1] = x[:, 1:]
        return y


def test_one_step_ahead_is_found_at_every_cut():
    for seed in SEEDS:
        report = audit(OneStepAhead(), example(seed), seed=seed)
        assert report.leaks_in == ["train", "eval"], report.table()
        for mode in ("train", "eval"):
            for name in ("random_future", "adversarial_future", "jacobian"):
                p = report.probe(name, mode)
                assert p.leaks and p.first_leaking_position == 0, report.table()
            # Position t moves whenever t + 1 is resampled: every cut 0..T-2 leaks, T-1 never does.
            assert report.probe("random_future", mode).leaking_positions == list(range(T - 1)), report.table()
