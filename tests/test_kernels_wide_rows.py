"""Dispatch and combine on rows wider than one column tile of the kernels (1024): the combine
weights' gradient dots each row with its token's output gradient over every tile, and combine
sums every tile. Against the dense float64 reference, in the Triton interpreter on CPU; fp32
kernels accumulate in fp32 over ~1100 terms (1e-5 of the largest value)."""

from __future__ import annotations

import torch
from extras import need

need("triton", "triton")

from causal_moe_kernels.dispatch_combine import combine, combine_reference  # noqa: E402
from causal_moe_kernels.metadata import routing_metadata  # noqa: E402


def test_combine_and_its_weight_gradient_over_rows_wider_than_one_tile():
    n, e, d = 5, 3, 1100
    gen = torch.Generator().manual_seed(4)
    token_A = torch.tensor([0, 0, 1, 2, 2, 3, 4])
    expert_A = torch.tensor([1, 2, 0, 0, 2, 1, 0])
    meta = routing_metadata(token_A, expert_A, n, e)
    rows64 = torch.randn(token_A.numel(), d, generator=gen, dtype=torch.float64)
    w64 = torch.rand(token_A.numel(), generator=gen, dtype=torch.float64)
    g_y = torch.randn(n, d, generator=gen, dtype=torch.float64)

    def run(fn, dtype):
        rows = rows64.to(dtype).requires_grad_()
        w = w64.to(dtype).requires_grad_()
        y = fn(rows, w)
        y.backward(g_y.to(y.dtype))
        return y.detach().double(), rows.grad.double(), w.grad.double()

    got = run(lambda r, w: combine(r, w, meta), torch.float32)
    want = run(lambda r, w: combine_reference(r, w, meta.perm_P, meta.token_P, n), torch.float64)
    for name, g, r in zip(("y", "drows", "dweight"), got, want):
        assert (g - r).abs().max() <= 1e-5 * r.abs().max(), name
