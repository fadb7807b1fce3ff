"""experiments/reduction_bias.py's reductions and figures on hand cases in bf16.

bf16 keeps 8 significant bits, so its spacing at 1 is 2^-7: 1 + 2^-8 is a tie and rounds to
the even 1, while 1 + 2^-7 is exact. Three workers holding (1, 2^-8, 2^-8) therefore sum to 1
along the ring ((1 + 2^-8) + 2^-8, each partial sum rounded), to 1 + 2^-7 along the tree
(1 + (2^-8 + 2^-8): an odd level adds its last two), and to 1 + 2^-7 when the ring accumulates
in fp32. Workers holding (2^-20, 1, -1) sum to 2^-20 exactly and to 0 along the ring: the
element is zeroed."""

from __future__ import annotations

import math

import pytest
import torch

import experiments.reduction_bias as rb

EPS = 2.0**-8


def workers(*columns: tuple[float, ...]) -> torch.Tensor:
    """float64 [W, n] from n per-element columns of W workers' values."""
    return torch.tensor(columns, dtype=torch.float64).T.contiguous()


def test_each_order_sums_in_its_own_order_and_dtype():
    x_Wn = workers((1.0, EPS, EPS), (3.0, 0.0, 0.0))
    exact = [1 + 2 * EPS, 3.0]
    assert rb.reduce(x_Wn, torch.bfloat16, "ring").tolist() == [1.0, 3.0]
    assert rb.reduce(x_Wn, torch.bfloat16, "tree").tolist() == exact
    assert rb.reduce(x_Wn, torch.bfloat16, "fp32_accumulate").tolist() == exact
    assert rb.reduce(x_Wn, torch.float32, "ring").tolist() == exact
    # what travels is rounded to the dtype before the fp32 sum: 1 + 2^-9 is 1 in bf16
    assert rb.reduce(workers((1 + EPS / 2, 0.0, 0.0)), torch.bfloat16, "fp32_accumulate").tolist() == [1.0]
    assert rb.reduce(x_Wn, torch.bfloat16, "ring").dtype == torch.float64
    # prescaled: each value divided by W = 4 first (exact in bf16), the ring's ties round to even,
    # the sum multiplied back: 4 * 0.25 = 1 where the exact sum is 1 + 2^-7
    x4_Wn = workers((1.0, EPS, EPS, 0.0), (3.0, 1.0, 0.0, 0.0))
    assert rb.reduce(x4_Wn, torch.bfloat16, "ring_prescaled").tolist() == [1.0, 4.0]
    with pytest.raises(ValueError, match="order must be one of"):
        rb.reduce(x_Wn, torch.bfloat16, "butterfly")


@pytest.mark.parametrize("num_workers", range(1, 8))
def test_the_tree_adds_every_worker_once(num_workers):
    """Powers of two, exact in fp32 at any grouping: the tree sum is the exact sum for odd and even W."""
    x_Wn = (2.0 ** torch.arange(num_workers, dtype=torch.float64)).view(-1, 1)
    assert rb.tree_sum(x_Wn.float()).tolist() == [2.0**num_workers - 1]
    assert rb.ring_sum(x_Wn.float(), torch.float32).tolist() == [2.0**num_workers - 1]


def test_the_figures_of_one_draw_against_their_definitions(monkeypatch):
    """bf16 ring over three elements: (1, 2^-8, 2^-8) loses 2^-7, (3, 0, 0) is exact, (2^-20, 1, -1)
    comes out 0. rel_error ||err|| / ||exact||, bias <err, exact> / ||exact||^2, elem_error the
    median of |err| / |exact|, zeroed the share of non-zero sums that came out 0."""
    x_Wn = workers((1.0, EPS, EPS), (3.0, 0.0, 0.0), (2.0**-20, 1.0, -1.0))
    monkeypatch.setattr(rb, "gradients", lambda num_workers, n, seed, regime: x_Wn)
    rows = rb._measure_one("noisy", 3, 3, trials=2)
    exact = [1 + 2 * EPS, 3.0, 2.0**-20]
    err = [-2 * EPS, 0.0, -(2.0**-20)]
    norm2 = sum(s * s for s in exact)
    (ring,) = [r for r in rows if (r["dtype"], r["order"]) == ("bf16", "ring")]
    assert ring["rel_error"] == pytest.approx(math.sqrt(sum(e * e for e in err) / norm2), rel=1e-12)
    assert ring["bias"] == pytest.approx(sum(e * s for e, s in zip(err, exact)) / norm2, rel=1e-12)
    assert ring["bias_se"] == 0.0  # the same draw twice
    assert ring["elem_error"] == pytest.approx(2 * EPS / (1 + 2 * EPS), rel=1e-12)  # of (0, 2^-7 / (1 + 2^-7), 1)
    assert ring["zeroed"] == pytest.approx(1 / 3, rel=1e-12)
    (tree,) = [r for r in rows if (r["dtype"], r["order"]) == ("bf16", "tree")]
    assert tree["zeroed"] == 0.0 and tree["elem_error"] == 0.0  # 1 + (2^-8 + 2^-8); 2^-20 + (1 - 1)
    assert [(r["dtype"], r["order"]) for r in rows] == [
        *((d, order) for d in ("fp16", "bf16") for order in rb.ORDERS),
        *(("fp32", order) for order in rb.ORDERS[:3]),
    ]  # fp32 accumulation of fp32 inputs is the ring itself
    assert {r["regime"] for r in rows} == {"noisy"} and {r["workers"] for r in rows} == {3}
    # an exact sum of 0 that comes out 0 is not zeroed: of (1, -1, 0) and (2^-20, 1, -1), one of two
    monkeypatch.setattr(
        rb, "gradients", lambda num_workers, n, seed, regime: workers((1.0, -1.0, 0.0), (2.0**-20, 1.0, -1.0))
    )
    (ring,) = [r for r in rb._measure_one("noisy", 3, 2, trials=1) if (r["dtype"], r["order"]) == ("bf16", "ring")]
    assert ring["zeroed"] == 0.5 and ring["bias_se"] is None


def test_the_drawn_gradients_are_exact_in_fp32_and_shared_by_seed():
    g = rb.gradients(4, 64, seed=3, regime="agreeing")
    assert g.dtype == torch.float64 and g.shape == (4, 64)
    assert torch.equal(g.float().double(), g)
    assert torch.equal(rb.gradients(4, 64, seed=3, regime="agreeing"), g)
    assert not torch.equal(rb.gradients(4, 64, seed=4, regime="agreeing"), g)
