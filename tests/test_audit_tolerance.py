"""The audit's tolerances pinned by leaks of known size, and positive controls that a slip in
the comparison (an off-by-one cut, a looser tolerance) would let through.

Targets here are the identity plus a planted leak into position 0 whose size is a stated
multiple of the tolerance the audit should use, so a tolerance 10x looser misses it.
Shapes: B=4, T=16, D=8.
"""

from __future__ import annotations

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
    """y = x, and y[:, 0] += size when the last position's first feature is positive: a jump
    of exactly ``size`` at position 0 (no gradient, so only forward comparisons see it)."""

    def __init__(self, size: float) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: Tensor) -> Tensor:
        y = x.float().clone()
        y[:, 0] += self.size * (x[:, -1, :1] > 0).float()
        return y.to(x.dtype)


class AlternatingNoise(StepLeak):
    """StepLeak plus ``noise`` added on every other call: a noise floor of exactly ``noise``."""

    def __init__(self, size: float, noise: float) -> None:
        super().__init__(size)
        self.noise, self.calls = noise, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x) + self.noise * (self.calls % 2)


def _scale(x: Tensor) -> float:
    return float(x.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_least_tolerance_is_pinned_by_a_leak_5x_above_it(dtype):
    eps = torch.finfo(dtype).eps
    for seed in SEEDS:
        x = example(seed, dtype)
        resolution = ULPS[dtype] * eps * _scale(x)
        leaky = audit(StepLeak(5 * resolution), x, seed=seed, modes=("eval",))
        assert leaky.leaks_in == ["eval"], f"a leak of 5x the {dtype} tolerance must be found\n{leaky.table()}"
        tol = leaky.probe("random_future", "eval").tolerance
        # The output scale includes the leak: at most (1 + 5 * ulps * eps) times the input's.
        top = resolution * (1 + 5 * ULPS[dtype] * eps) * 1.01
        assert 0.99 * resolution <= tol <= top, f"tolerance {tol:.3e}, expected {resolution:.3e} to {top:.3e}"
        clean = audit(StepLeak(0.0), x, seed=seed, modes=("eval",))
        assert clean.leaks_in == [], clean.table()


def test_noise_floor_factor_is_pinned():
    """A floor of 0.5 resolution gives a tolerance of 5 resolutions (10x the floor); a leak of
    20 resolutions is found; with the factor 10x larger (100x the floor) it would be missed."""
    for seed in SEEDS:
        x = example(seed)
        resolution = ULPS[torch.float32] * torch.finfo(torch.float32).eps * _scale(x)
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
