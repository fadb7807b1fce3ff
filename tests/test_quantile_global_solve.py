"""Global quantile balancing's bias from a hand histogram: the K/E quantile of each expert's
required biases, linear inside the bin that holds it, then centred. E 2, K 1, R 4 bins over
[min(b) - 1, max(b) + 1] = [-1, 1] (width 0.5), 8 counts each, so the quantile is where the
4th count is reached:

* expert 0, counts [0, 4, 4, 0]: the 4th count ends bin 1: -1 + 0.5 * 2 = 0;
* expert 1, counts [3, 2, 2, 1]: 3 counts before bin 1, one more of its 2: -1 + 0.5 * 1.5 = -0.25;

centred (mean -0.125): [0.125, -0.125]."""

from __future__ import annotations

import torch

import moe


def test_solved_bias_interpolates_inside_the_bin_then_centres():
    r = moe.build_router("quantile_global", d_model=4, num_experts=2, top_k=1, num_bins=4)
    r.solve_bias(torch.tensor([[0, 4, 4, 0], [3, 2, 2, 1]]))
    assert torch.allclose(r.balance_bias, torch.tensor([0.125, -0.125]), rtol=0, atol=1e-7)
