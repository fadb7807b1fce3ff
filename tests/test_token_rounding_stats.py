"""Token rounding's ``rounded_in`` and ``rounded_out`` with k > 1: the pairs rounding added to and
dropped from the top-k choices, each counted per N*k slots (top-1 cases cannot tell N*k from N)."""

from __future__ import annotations

import pytest
import torch
from helpers import assignments, identity_router


@pytest.mark.parametrize("rounding", ["up", "down"])
def test_rounded_pairs_are_counted_per_top_k_slot(rounding):
    n, e, k = 3 * 9, 6, 2
    x = torch.randn(3, 9, e, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    r = identity_router("token_rounding", e, top_k=k, tile_size=4, rounding=rounding)
    trained = set(assignments(r.train()(x)))
    topk = set(assignments(r.eval()(x)))  # serving: plain top-k, each token's k best
    assert len(topk) == n * k
    stats = r.train()(x).stats
    added, dropped = len(trained - topk), len(topk - trained)
    assert added + dropped > 0
    assert stats["rounded_in"].item() == pytest.approx(added / (n * k), rel=1e-6)  # a float32 stat
    assert stats["rounded_out"].item() == pytest.approx(dropped / (n * k), rel=1e-6)
