"""The null-expert router's Switch loss balances all E + M columns, with the choices that fell on
a null expert counted (AdaMoE, arXiv 2406.13233): aux = coef * (E + M) * sum_j f_j * P_j, where
f_j is the fraction of the N * k choices that went to column j and P_j the mean router
probability of column j, over real and null columns alike. A hand-worked case of 3 tokens,
E = 2 real and M = 2 null experts, top-2."""

from __future__ import annotations

import pytest
import torch

import moe

E, M, K = 2, 2, 2
PROBS = [  # router probabilities over [real 0, real 1, null 0, null 1]; top-2 in brackets
    [0.5, 0.25, 0.125, 0.125],  # [real 0, real 1]
    [0.125, 0.25, 0.5, 0.125],  # [null 0, real 1]
    [0.0625, 0.0625, 0.5, 0.375],  # [null 0, null 1]: no real expert
]
# choices per column: 1, 2, 2, 1 of 6 -> f = 1/6, 2/6, 2/6, 1/6
# P = (0.6875, 0.5625, 1.125, 0.625) / 3
# aux = 4 * (1 * 0.6875 + 2 * 0.5625 + 2 * 1.125 + 1 * 0.625) / 18 = 4 * 4.6875 / 18
HAND_AUX = 4 * 4.6875 / 18


def null_router(coef: float) -> moe.Router:
    """Top-2 over 2 real + 2 null experts whose four logits are the four input features."""
    r = moe.build_router(
        "topk", d_model=E + M, num_experts=E, top_k=K, null_experts=M, aux_loss_coef=coef, z_loss_coef=0.0
    ).double()
    eye = torch.eye(E + M, dtype=torch.float64)
    with torch.no_grad():
        r.gate.weight.copy_(eye[:E])
        r.null_gate.weight.copy_(eye[E:])
    return r


def test_switch_loss_counts_null_choices_over_all_columns():
    coef = 0.5
    out = null_router(coef)(torch.tensor([PROBS], dtype=torch.float64).log())
    kept = sorted(zip(out.token.tolist(), out.expert.tolist()))
    assert kept == [(0, 0), (0, 1), (1, 1)], kept  # the hand case routes as the comment says
    assert out.aux_loss.item() == pytest.approx(coef * HAND_AUX, rel=1e-12), (out.aux_loss.item(), coef * HAND_AUX)


def test_switch_loss_matches_a_per_token_loop_on_random_logits():
    """The same definition written as a loop over tokens and choices, on logits where real and
    null experts are picked in varied proportions."""
    gen = torch.Generator().manual_seed(5)
    x = 2 * torch.randn(3, 7, E + M, dtype=torch.float64, generator=gen)
    out = null_router(1.0)(x)
    probs = torch.softmax(x.reshape(-1, E + M), -1).tolist()
    count = [0] * (E + M)
    for row in probs:
        for j in sorted(range(E + M), key=lambda j: -row[j])[:K]:
            count[j] += 1
    n = len(probs)
    mean_p = [sum(row[j] for row in probs) / n for j in range(E + M)]
    ref = (E + M) * sum(count[j] / (n * K) * mean_p[j] for j in range(E + M))
    assert count[E] + count[E + 1] > 0 and count[0] + count[1] > 0, count  # both kinds chosen
    assert out.aux_loss.item() == pytest.approx(ref, rel=1e-12), (out.aux_loss.item(), ref)
