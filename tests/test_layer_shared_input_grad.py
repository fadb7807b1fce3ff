"""An MoE layer with (gated) shared experts passes the gradient of its input through both
paths: the input gradient of ``layer(x)`` is that of its routed path (the same router and
experts in a layer without shared experts) plus that of its shared block, each computed on
its own leaf, in float64."""

from __future__ import annotations

import pytest
import torch

import moe


@pytest.mark.parametrize("gated", [False, True])
def test_input_gradient_is_the_routed_plus_the_shared_paths(gated):
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 6, 4, router="topk", top_k=2, shared_experts=2, shared_expert_gate=gated).double()
    routed = moe.MoELayer(8, 6, 4, router=layer.router, experts=layer.experts).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    g = torch.randn(2, 5, 8, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for _ in range(3)]
    (layer(leaves[0]) * g).sum().backward()
    (routed(leaves[1]) * g).sum().backward()
    (layer.shared(leaves[2]) * g).sum().backward()
    assert leaves[2].grad.abs().sum() > 0
    assert torch.allclose(leaves[0].grad, leaves[1].grad + leaves[2].grad, rtol=0, atol=1e-12)
