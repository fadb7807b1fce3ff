"""Decoding's sampler (moe/generation.py) against its definition: ``top_k`` samples among the k
most likely tokens, in proportion to their softmax (at the temperature) renormalised over the k,
and ``generate`` passes ``top_k`` and ``temperature`` to every sampled token."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe.generation import _sample, generate


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / tokens.numel()).tolist()


@pytest.mark.parametrize("top_k, temperature", [(1, 1.0), (2, 1.0), (3, 0.5), (4, 2.0), (9, 1.0)])
def test_top_k_samples_the_k_most_likely_in_proportion(top_k, temperature):
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    n = 20_000
    gen = torch.Generator().manual_seed(top_k)
    got = frequencies(_sample(logits.expand(n, 5).clone(), temperature, top_k, gen), 5)
    kept = sorted(range(5), key=lambda i: -logits[i].item())[:top_k]
    z = sum(math.exp(logits[i].item() / temperature) for i in kept)
    want = [math.exp(logits[i].item() / temperature) / z if i in kept else 0.0 for i in range(5)]
    for i in range(5):
        if want[i] == 0.0:
            assert got[i] == 0.0, (i, got)
        else:
            assert got[i] == pytest.approx(want[i], abs=4 * math.sqrt(want[i] * (1 - want[i]) / n) + 1e-9), (i, got)


class FixedLM(nn.Module):
    """A causal LM of vocabulary 5 whose next-token logits are always ``LOGITS`` (no cache needed)."""

    LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))

    def decode_support(self):
        return None

    def init_cache(self, b, max_len):
        return None

    def forward(self, idx_BT, cache=None):
        b, t = idx_BT.shape
        return type("Out", (), {"logits": self.LOGITS.expand(b, t, 5).clone()})()


def test_generate_samples_every_new_token_within_top_k():
    out = generate(FixedLM(), torch.zeros(64, 1, dtype=torch.long), 30, context=64, top_k=2, seed=0)
    new = out[:, 1:]
    assert set(new.unique().tolist()) == {1, 3}  # the two most likely, both drawn
    out = generate(FixedLM(), torch.zeros(8, 1, dtype=torch.long), 10, context=64, temperature=0)
    assert (out[:, 1:] == 1).all()  # greedy
