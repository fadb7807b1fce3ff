"""``moe.routers.sinkhorn.sinkhorn`` runs exactly ``iterations`` rounds: the balanced matrix
after 1, 2 and 3 rounds against the element-by-element float64 reference of
``test_sinkhorn_router`` (the routing tests compare top-k choices, which a round more or less
rarely changes)."""

from __future__ import annotations

import pytest
import torch
from test_sinkhorn_router import reference_sinkhorn

from moe.routers.sinkhorn import sinkhorn


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_sinkhorn_matrix_after_each_number_of_rounds(iterations):
    x_NE = torch.randn(7, 4, generator=torch.Generator().manual_seed(13), dtype=torch.float64) * 2
    want = torch.tensor(reference_sinkhorn(x_NE.tolist(), iterations), dtype=torch.float64)
    got = sinkhorn(x_NE, iterations)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.allclose(got.sum(0), torch.full((4,), 1 / 4, dtype=torch.float64), rtol=1e-6)  # columns last
