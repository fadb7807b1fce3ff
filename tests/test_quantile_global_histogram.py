"""Global quantile balancing's histograms after one training forward: every token adds, per
expert, its required bias r = alpha - s (alpha its (k+1)-th best score) to the bin of
R uniform bins over [min(b) - 1, max(b) + 1] that holds it (floor, clamped to the range).
Counted here one token and expert at a time in float64."""

from __future__ import annotations

import math

import torch
from helpers import identity_router


def test_each_forward_adds_every_required_bias_to_the_bin_that_holds_it():
    e, k, bins = 4, 1, 8
    r = identity_router("quantile_global", e, top_k=k, num_bins=bins).train()
    x = torch.randn(2, 5, e, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    r(x)
    want = torch.zeros(e, bins, dtype=torch.int64)
    for s in torch.sigmoid(x.reshape(-1, e)).tolist():
        alpha = sorted(s, reverse=True)[k]
        for j in range(e):
            want[j, min(bins - 1, max(0, math.floor((alpha - s[j] + 1.0) / (2.0 / bins))))] += 1
    assert torch.equal(r.histogram_ER, want)
