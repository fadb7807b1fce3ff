"""moe.MoELayer's shared and latent paths against a naive float64 reference written out here
(the routed sum from tests.helpers.naive_moe, the gated shared SwiGLU and the latent projections
by hand), and its active feed-forward width against the formula counted by hand."""

import pytest
import torch
import torch.nn.functional as F
from helpers import naive_moe

import moe
from moe.layer import active_ffn_width


def swiglu(x, w_gate, w_up, w_down):
    """x @ ... for nn.Linear weights [out, in]."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def test_gated_shared_experts_scale_by_the_gate_of_the_input():
    torch.manual_seed(0)
    layer = moe.MoELayer(6, 5, 4, router="topk", top_k=2, shared_experts=2, shared_expert_gate=True).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with torch.no_grad():
        y, routing = layer(x, return_routing=True)
        ffn = layer.shared.ffn
        shared = swiglu(x, ffn.w_gate.weight, ffn.w_up.weight, ffn.w_down.weight)
        gate = torch.sigmoid(x @ layer.shared.gate.weight.T)
        expected = naive_moe(layer, x, routing) + gate * shared
    assert ffn.w_gate.weight.shape == (2 * 5, 6)
    assert torch.allclose(y, expected, atol=1e-12)


def test_latent_experts_run_between_the_down_and_up_projections():
    torch.manual_seed(1)
    layer = moe.MoELayer(8, 5, 4, router="topk", top_k=2, latent_dim=3).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        y, routing = layer(x, return_routing=True)
        z = x @ layer.latent.down.weight.T
        expected = naive_moe(layer, z, routing) @ layer.latent.up.weight.T
    assert torch.allclose(y, expected, atol=1e-12)


@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("latent", [None, 4])
def test_active_ffn_width_counts_routed_shared_and_latent_weights(shared, latent):
    d, f, k = 12, 7, 2
    layer = moe.MoELayer(d, f, 6, router="topk", top_k=k, shared_experts=shared, latent_dim=latent)
    routed = k * f if latent is None else (3 * k * latent * f + 2 * d * latent) / (3 * d)
    assert layer.active_ffn_width() == pytest.approx(routed + shared * f)
    assert active_ffn_width(layer.router, f, shared, latent) == pytest.approx(routed + shared * f)
    if latent is not None:  # the latent part in weights: k experts of 3*L*F, the projections 2*D*L
        assert 3 * d * routed == pytest.approx(k * 3 * latent * f + 2 * d * latent)
