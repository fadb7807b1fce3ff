"""A target whose random draws rarely change its output (a drop path over the batch's samples,
Megatron-DeepSpeed's ``DropPath`` at rate 0.1 on two samples) may repeat itself under every
seed the calibration tries: it is then judged by a fixed seed, yet perturbed copies packed into
one forward draw other masks than the example alone. Every move such a target shows is confirmed
before it counts (moe.audit.comparator: ``NOISE_SEEDS``, ``Comparator._rare_noise``)."""

from __future__ import annotations

import torch
from torch import nn

from moe.audit import audit
from moe.audit.comparator import NOISE_SEEDS, calibrate
from moe.audit.runner import Runner
from moe.audit.target import AuditTarget


class DropPath(nn.Module):
    """x + drop_path(W x): each sample's branch dropped with probability p in training (per sample,
    no rescaling). Causal and batch-invariant in law; ``leak`` adds a mean over the sequence."""

    def __init__(self, p: float, leak: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p, self.leak = p, leak
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            h = h * (torch.rand(x.shape[0], 1, 1) >= self.p).to(h.dtype)
        return x + h + self.leak * x.mean(1, keepdim=True)


def example() -> torch.Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


SEED = 4
"""An audit seed under which the drop path at 0.02 drops nothing in the example nor under the
NOISE_SEEDS other seeds (judged by a fixed seed), while packs of perturbed copies drop some
copies' branches: what made the audit report a leak before moves were confirmed."""


def test_a_rarely_firing_drop_path_is_judged_by_a_fixed_seed_and_not_called_a_leak():
    report = audit(DropPath(0.02), example(), modes=("train",), seed=SEED)
    assert report.regimes == {"train": "deterministic"}  # the case: no seed showed its noise
    assert not report.leaks, report.summary()
    assert report.batch_invariant and report.decode_consistent


def test_a_real_leak_beside_rare_noise_is_still_found():
    report = audit(DropPath(0.02, leak=1e-2), example(), modes=("train",), seed=SEED)
    assert report.regimes == {"train": "deterministic"}
    assert report.leaks_in == ["train"], report.summary()


class DrawOnce(nn.Module):
    """x + [u < 0.5] * x for one uniform draw u a forward: the output changes with the seed only
    where u falls on the other side of 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (torch.rand(()) < 0.5).to(x.dtype) * x


def _first_uniform(seed: int) -> float:
    return float(torch.rand((), generator=torch.Generator().manual_seed(seed)))


def test_the_calibration_tries_several_seeds_before_calling_a_drawing_target_fixed():
    # A seed whose next seed draws on the same side of 0.5, and a later one of the NOISE_SEEDS on
    # the other side: one other seed would call the target deterministic.
    side = [_first_uniform(s) < 0.5 for s in range(200)]
    seed = next(
        s for s in range(200 - NOISE_SEEDS) if side[s] == side[s + 1] and len(set(side[s : s + NOISE_SEEDS + 1])) == 2
    )
    x = example()
    at = AuditTarget(DrawOnce())
    with at.state.preserved():
        cal = calibrate(Runner(at, seed), x)
    assert cal.stochastic and cal.regime == "seeded"


class ShortDropout(nn.Module):
    """Drops half of W x's positions (no rescaling) on inputs shorter than 16, none at 16: the
    example (T 16) draws noise that never shows, its prefixes noise that does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape[0], x.shape[1], 1) >= (0.5 if x.shape[1] < 16 else 0.0)
        return x + self.lin(x) * keep.to(x.dtype)


def test_a_prefix_moved_by_noise_the_example_never_showed_is_judged_by_distribution():
    report = audit(ShortDropout(), example(), modes=("eval",))
    assert report.regimes == {"eval": "deterministic"}
    assert not report.leaks
    decode = next(p for p in report.probes if p.kind == "decode")
    assert decode.p_value is not None and decode.leaks  # in law, a prefix keeps half of the branch
