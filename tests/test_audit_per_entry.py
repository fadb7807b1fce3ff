"""The audit's tolerance is per entry: a change counts against the scale of the entry it moves
(the larger of its values before and after, at least the median |entry| of its output row),
never against the largest entry of the output. A massive CHANNEL here (one feature far larger
than the rest at every position, as LLM residual streams carry; Sun et al. 2024, arXiv
2402.17762), where tests/test_audit_massive_activation.py has one massive entry at position 0:

* a future-dependent jump of 5x the fp32 resolution (100 ulp) in every small entry of position 0
  is a leak, though it is ~1e-7 of the massive entries beside it in the same row;
* a jump of half the resolution in the massive entry alone is rounding at that entry's scale,
  though it is thousands of times the row's small entries;
* an entry that is exactly 0 before is judged at its row's median scale: a change of a quarter of
  the resolution times that median is no leak.

Shapes: B=4, T=16, D=8. Only the public API: ``audit`` and its report's fields.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.audit import audit

B, T, D = 4, 16, 8
MASSIVE = 3000.0
RESOLUTION = 100 * torch.finfo(torch.float32).eps
"""The audit's least relative change in fp32 (its documented 100 ulp)."""


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


class MassiveChannel(nn.Module):
    """y = x with feature 0 raised by MASSIVE at every position; position 0's entries in
    ``features`` jump by ``rel`` times themselves when the last position's feature 1 is positive;
    ``zero_entry``: position 0's feature 1 is 0, plus ``add`` times the row median when the future
    says so."""

    def __init__(self, rel: float = 0.0, features: slice = slice(1, None), add: float = 0.0) -> None:
        super().__init__()
        self.rel, self.features, self.add = rel, features, add

    def forward(self, x_BTD: Tensor) -> Tensor:
        y = x_BTD.clone()
        y[..., 0] = y[..., 0] + MASSIVE
        future_B1 = (x_BTD[:, -1, 1:2] > 0).float()
        y[:, 0, self.features] = y[:, 0, self.features] * (1 + self.rel * future_B1)
        if self.add:
            median_B1 = y[:, 0].abs().median(-1, keepdim=True).values
            y[:, 0, 1:2] = self.add * median_B1 * future_B1
        return y


def test_a_leak_in_small_entries_beside_a_massive_channel_is_found():
    for seed in range(3):
        report = audit(MassiveChannel(rel=5 * RESOLUTION), example(seed), seed=seed, modes=("eval",))
        p = report.probe("random_future", "eval")
        assert p.leaks and p.first_leaking_position == 0, report.table()
        # the change, ~5e-4 of entries of size ~1, is under 1e-6 of the 3000 entries in its row
        assert p.max_abs_delta < 1e-6 * MASSIVE, report.table()


def test_rounding_size_changes_are_judged_at_their_own_entrys_scale():
    for seed in range(3):
        massive_only = MassiveChannel(rel=0.5 * RESOLUTION, features=slice(0, 1))
        report = audit(massive_only, example(seed), seed=seed, modes=("eval",))
        assert report.leaks_in == [], report.table()
        zero_entry = MassiveChannel(add=0.25 * RESOLUTION)
        report = audit(zero_entry, example(seed), seed=seed, modes=("eval",))
        assert report.leaks_in == [], report.table()
    # controls: the same changes at 5x the resolution are found, so the two above were judged, not missed
    for target in (MassiveChannel(rel=5 * RESOLUTION, features=slice(0, 1)), MassiveChannel(add=5 * RESOLUTION)):
        assert audit(target, example(), modes=("eval",)).leaks_in == ["eval"]
