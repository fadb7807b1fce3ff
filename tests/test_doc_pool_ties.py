"""A document's pool among tied experts takes the lower indices (``moe.routers.doc_pool``: "ties:
the lower index"), with E = 64, where an unstable sort on CPU no longer keeps index order: four
experts lead and the other sixty tie, and with k = P every token takes exactly the pool worked
out here."""

from __future__ import annotations

import pytest
import torch
from helpers import assignments, identity_router


@pytest.mark.parametrize("pool_from", ["prefix", "document"])
def test_tied_experts_enter_the_pool_by_index(pool_from):
    e, pool = 64, 8
    r = identity_router("doc_pool", e, document_expert_pool=pool, top_k=pool, pool_from=pool_from)
    x = torch.zeros(2, 5, e, dtype=torch.float64)
    x[..., 60:] = 1.0
    want = [(n, j) for n in range(10) for j in (0, 1, 2, 3, 60, 61, 62, 63)]
    assert assignments(r(x)) == want
