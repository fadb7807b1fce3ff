"""The load-balancing loss at top_k = 2, worked by hand: with two choices per token the
fraction routed to an expert is over assignments (2N), not tokens (N)."""

import math

import pytest
import torch
from helpers import identity_router


def test_load_balance_loss_top2_counts_assignments():
    r = identity_router("topk", 3, top_k=2, aux_loss_coef=1.0, z_loss_coef=0.0)
    # Top-2 of each row: token 0 -> {0, 1}, token 1 -> {0, 2}, token 2 -> {1, 2}, token 3 -> {0, 1}.
    x = torch.tensor([[[3.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 0.5, 0.0]]], dtype=torch.float64)
    # 8 assignments: expert 0 has 3, expert 1 has 3, expert 2 has 2.
    frac = [3 / 8, 3 / 8, 2 / 8]
    rows = [[3.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 0.5, 0.0]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    mean_p = [sum(p[e] for p in probs) / 4 for e in range(3)]
    expected = 3 * sum(f * m for f, m in zip(frac, mean_p))  # coef * E * sum_e frac_e * mean prob_e
    got = r(x).aux_loss.item()
    assert got == pytest.approx(expected, rel=1e-12), (
        f"aux loss {got}, expected {expected} (tokens-counted: {2 * expected})"
    )
