"""An MoE layer with (gated) shared experts passes the gradient of its input through both
paths: the input gradient of ``layer(x)`` is that of its routed path (the same router and
experts in a layer without shared experts) plus that of its shared block, each computed on
its own leaf, in float64; the gated shared block against its formula written out per token."""

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


def test_the_gated_shared_block_is_the_sigmoid_of_one_dot_product_times_its_swiglu():
    """Per token, in float64 written out: sigmoid(x . w) * W_down(silu(W_gate x) * W_up x), the
    Qwen2-MoE / Megatron gate; a gate asked for without shared experts is refused."""
    torch.manual_seed(0)
    shared = moe.MoELayer(4, 3, 2, router="topk", top_k=1, shared_experts=2, shared_expert_gate=True).double().shared
    x = torch.randn(5, 4, dtype=torch.float64)
    f = shared.ffn

    def sigmoid(a):
        return 1 / (1 + torch.exp(-a))

    for n in range(5):
        gate_F, up_F = f.w_gate.weight @ x[n], f.w_up.weight @ x[n]  # F = 2 shared experts x 3
        want = sigmoid(shared.gate.weight[0] @ x[n]) * (f.w_down.weight @ (gate_F * sigmoid(gate_F) * up_F))
        assert torch.allclose(shared(x[n : n + 1])[0], want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="shared_expert_gate needs shared_experts > 0"):
        moe.MoELayer(4, 3, 2, router="topk", top_k=1, shared_expert_gate=True)
