"""Exact mode's own forms (moe/exact.py) against float64 references: attention with grouped
query heads (each query head reads key/value head h // (Hq / Hkv), as
``scaled_dot_product_attention(enable_gqa=True)``), and ``stable_topk``'s ties, which go to the
lower index (an expert index for routers) whatever the tensor's size."""

from __future__ import annotations

import pytest
import torch

from moe.exact import KEY_BLOCK, exact_attention, stable_topk


def reference_attention(q, k, v, allowed):
    """float64 softmax(q k^T / sqrt(Dh) + mask) v, query head h reading kv head h // group."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kv = h // group
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, kv]
    return out


@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (4, 1), (2, 2)])
def test_grouped_query_attention_reads_each_query_heads_own_kv_head(heads):
    hq, hkv = heads
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    b, t, s, dh = 2, 5, KEY_BLOCK + 6, 8  # keys over more than one block
    q = torch.randn(b, hq, t, dh, generator=g)
    k = torch.randn(b, hkv, s, dh, generator=g)
    v = torch.randn(b, hkv, s, dh, generator=g)
    allowed = torch.rand(t, s, generator=g) < 0.7
    allowed[:, 0] = True
    got = exact_attention(q, k, v, attn_mask=allowed, enable_gqa=hq != hkv)
    want = reference_attention(q, k, v, allowed)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("n", [8, 64, 300, 2049])
def test_stable_topk_breaks_ties_by_the_lower_index(largest, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 3, (16, n), generator=g).float()
    k = min(n, 7)
    values, indices = stable_topk(x, k, dim=-1, largest=largest)
    for row in range(x.shape[0]):
        vals = x[row].tolist()
        want = sorted(range(n), key=lambda i: (-vals[i] if largest else vals[i], i))[:k]
        assert indices[row].tolist() == want, (row, indices[row].tolist(), want)
        assert values[row].tolist() == [vals[i] for i in want]
