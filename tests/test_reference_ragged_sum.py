"""The reference data path's per-token sums when tokens have different numbers of rows: bit for
bit the zero-padded [N, S, D] layout reduced over S in slot order, written out here. The padding
adds +0 after a token's last row, which turns a -0 sum into +0 (``torch.equal`` cannot tell the
two apart, so the sign bits are compared too)."""

from __future__ import annotations

import functools

import torch

from causal_moe_kernels.reference import scatter_sum, token_slots


def padded_sum(rows_AD: torch.Tensor, token_A: torch.Tensor, slot_A: torch.Tensor, s: int, n: int) -> torch.Tensor:
    padded_NSD = rows_AD.new_zeros(n, s, rows_AD.shape[1])
    padded_NSD[token_A, slot_A] = rows_AD
    return functools.reduce(torch.add, padded_NSD.unbind(1))


def test_ragged_sums_are_the_padded_layouts_bit_for_bit_signed_zeros_included():
    token_A = torch.tensor([2, 0, 2, 3, 2, 0])  # token 2 has 3 rows, token 0 two, token 3 one, token 1 none
    rows_AD = torch.randn(6, 4, generator=torch.Generator().manual_seed(11))
    rows_AD[3] = -0.0  # token 3's only row: its padded sum is -0 + 0 + 0 = +0
    rows_AD[1, :2] = -0.0
    rows_AD[5, :2] = -0.0  # token 0: -0 + -0 = -0, then + 0 = +0 in its first two columns
    slot_A, s = token_slots(token_A, 4)
    assert s == 3
    got = scatter_sum(rows_AD, token_A, slot_A, s, 4)
    want = padded_sum(rows_AD, token_A, slot_A, s, 4)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert not bool(want[3].signbit().any())
