"""The reference data path's combine against a per-token loop (float64): both layouts of
``scatter_sum`` (every token with S rows, a permutation; tokens with fewer rows, a padded
buffer) and ``combine_rows``' written-out backward against autograd through the loop."""

from __future__ import annotations

import pytest
import torch

from causal_moe_kernels.reference import combine_rows, scatter_sum, sort_by_expert, token_slots

# (token_A, expert_A): every token with two rows (dropless top-2), and tokens with none, one
# and three rows (expert choice), in an order where sorting by expert interleaves tokens
LAYOUTS = {
    "all_full": (torch.arange(5).repeat_interleave(2), torch.tensor([2, 0, 1, 2, 0, 1, 2, 1, 0, 2])),
    "ragged": (torch.tensor([3, 0, 3, 1, 3, 0]), torch.tensor([0, 1, 2, 2, 1, 0])),
}
N, D = 5, 6


def sorted_layout(name: str):
    token_A, expert_A = LAYOUTS[name]
    order_A, _ = sort_by_expert(expert_A, 3)
    token_sorted_A = token_A[order_A]
    slot_A, num_slots = token_slots(token_sorted_A, N)
    return order_A, token_sorted_A, slot_A, num_slots


def loop_sum(rows_AD: torch.Tensor, token_A: torch.Tensor, slot_A: torch.Tensor) -> torch.Tensor:
    """out[n] = 0 + its rows one by one in slot order: the order the reference promises."""
    out = [torch.zeros(rows_AD.shape[1], dtype=rows_AD.dtype) for _ in range(N)]
    for a in sorted(range(len(token_A)), key=lambda a: (int(token_A[a]), int(slot_A[a]))):
        out[int(token_A[a])] = out[int(token_A[a])] + rows_AD[a]
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_scatter_sum_equals_the_slot_ordered_loop(name):
    _, token_sorted_A, slot_A, num_slots = sorted_layout(name)
    rows_AD = torch.randn(len(token_sorted_A), D, dtype=torch.float64)
    got = scatter_sum(rows_AD, token_sorted_A, slot_A, num_slots, N)
    assert torch.equal(got, loop_sum(rows_AD, token_sorted_A, slot_A)), got - loop_sum(rows_AD, token_sorted_A, slot_A)
    assert (len(token_sorted_A) == N * num_slots) == (name == "all_full"), "which branch runs"
    if name == "ragged":
        assert got[[2, 4]].abs().max() == 0, "tokens 2 and 4 have no row"


def padded_sum(rows_AD, token_A, slot_A, num_slots, num_tokens):
    """The reference's sum as first written: a zero [N, S, D] buffer, each row put at its
    (token, slot), the slots added in order (zeros after a token's last row)."""
    buf = rows_AD.new_zeros(num_tokens, num_slots, rows_AD.shape[1])
    buf[token_A, slot_A] = rows_AD
    out = buf[:, 0]
    for s in range(1, num_slots):
        out = out + buf[:, s]
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [0.05, 0.3, 0.7])
def test_ragged_scatter_sum_is_the_padded_sum_bit_for_bit(dtype, share):
    """Tokens with 0..E rows (expert threshold, expert choice): the same bits as the padded
    layout, signed zeros included (a -0 row alone, or before zero padding, comes out as the
    padding makes it)."""
    gen = torch.Generator().manual_seed(int(share * 100))
    n, e, d = 40, 6, 16
    token_A, expert_A = (torch.rand(n, e, generator=gen) < share).nonzero(as_tuple=True)
    order_A, _ = sort_by_expert(expert_A, e)
    token_sorted_A = token_A[order_A]
    slot_A, num_slots = token_slots(token_sorted_A, n)
    rows_AD = torch.randn(len(token_sorted_A), d, generator=gen).to(dtype)
    rows_AD[::3, : d // 2] = -0.0
    got = scatter_sum(rows_AD, token_sorted_A, slot_A, num_slots, n)
    want = padded_sum(rows_AD, token_sorted_A, slot_A, num_slots, n)
    assert len(token_sorted_A) != n * num_slots, "the ragged branch runs"
    assert torch.equal(torch.signbit(got), torch.signbit(want)), "signed zeros differ"
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_combine_rows_gradients_equal_autograd_through_the_loop(name):
    order_A, token_sorted_A, slot_A, num_slots = sorted_layout(name)
    a = len(token_sorted_A)
    rows = torch.randn(a, D, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(a, dtype=torch.float64, requires_grad=True)
    grad_ND = torch.randn(N, D, dtype=torch.float64)
    y = combine_rows(rows, weight[order_A], token_sorted_A, slot_A, num_slots, N)
    got = torch.autograd.grad(y, (rows, weight), grad_ND)
    y_ref = loop_sum(rows * weight[order_A].unsqueeze(-1), token_sorted_A, slot_A)
    want = torch.autograd.grad(y_ref, (rows, weight), grad_ND)
    assert (y - y_ref).abs().max() <= 1e-15, f"output max {(y - y_ref).abs().max():.3e}"
    for what, g, w in zip(("rows", "weight"), got, want, strict=True):
        d = (g - w).abs()
        assert d.max() <= 1e-15, f"grad {what}: max {d.max():.3e} mean {d.mean():.3e}"
