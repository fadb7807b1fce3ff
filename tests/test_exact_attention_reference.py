"""Exact mode's own forms (moe/exact.py) against float64 references: attention with grouped
query heads (each query head reads key/value head h // (Hq / Hkv), as
``scaled_dot_product_attention(enable_gqa=True)``), a given softmax scale, ``blocked_linear``'s
bias and the warning for attention dropout, and ``stable_topk``'s ties, which go to the lower
index (an expert index for routers) whatever the tensor's size."""

from __future__ import annotations

import pytest
import torch

from moe.exact import KEY_BLOCK, ExactnessWarning, blocked_linear, exact_attention, exact_mode, stable_topk


def reference_attention(q, k, v, allowed, scale=None):
    """float64 softmax(q k^T * scale + mask) v (scale 1 / sqrt(Dh) unless given), query head h
    reading kv head h // group."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kv = h // group
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
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


def test_a_given_scale_a_linear_bias_and_dropout_asked_for():
    """What a target's own attention and linear layers pass: a softmax scale other than
    1 / sqrt(Dh) is used, a bias is added, and attention dropout in exact mode is named as inexact."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    got = exact_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, causal, scale=0.3), atol=1e-6, rtol=1e-6)
    x, w, bias = torch.randn(3, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(2, generator=g)
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(blocked_linear(x, w, bias).double(), want, atol=1e-6, rtol=1e-6)
    with exact_mode(), pytest.warns(ExactnessWarning, match="attention with dropout cannot be exact"):
        exact_attention(q, k, v, dropout_p=0.1)
