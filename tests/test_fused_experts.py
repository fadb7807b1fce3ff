"""FusedSwiGLUExperts (transformers' expert layout) against SwiGLUExperts, and MoELayer(experts=...)."""

import pytest
import torch
from extras import needs

from moe import MoELayer
from moe.experts import FusedSwiGLUExperts, SwiGLUExperts

E, D, F, N = 4, 8, 6, 10


def fused_from(split: SwiGLUExperts) -> FusedSwiGLUExperts:
    """The same experts in the fused, output-major layout (an independent rearrangement)."""
    gate_up = torch.cat([split.w_gate.detach().transpose(1, 2), split.w_up.detach().transpose(1, 2)], dim=1)
    down = split.w_down.detach().transpose(1, 2)
    return FusedSwiGLUExperts(torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone()))


def per_token_reference(x, token, expert, weight, gate_up, down):
    """y[n] = sum_a weight[a] * SwiGLU_e(x[n]), one assignment at a time, from the fused tensors."""
    y = torch.zeros_like(x)
    for n, e, w in zip(token.tolist(), expert.tolist(), weight):
        g, u = (gate_up[e] @ x[n]).chunk(2)
        y[n] = y[n] + w * (down[e] @ (torch.nn.functional.silu(g) * u))
    return y


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs("triton", "triton"))])
def test_fused_layout_matches_a_per_token_reference_with_gradients(backend):
    dtype = torch.float64 if backend == "torch" else torch.float32  # the Triton kernels run fp32 at most
    torch.manual_seed(1)
    fused = FusedSwiGLUExperts(
        torch.nn.Parameter(torch.randn(E, 2 * F, D, dtype=dtype)), torch.nn.Parameter(torch.randn(E, D, F, dtype=dtype))
    )
    x = torch.randn(N, D, dtype=dtype, requires_grad=True)
    token = torch.tensor([0, 0, 1, 3, 3, 4, 6, 6, 7, 9])  # tokens 2, 5, 8 get no expert
    expert = torch.tensor([1, 3, 1, 0, 3, 1, 2, 0, 1, 1])  # expert 1 takes five rows, 2 one
    weight = torch.rand(token.numel(), dtype=dtype, requires_grad=True)
    y = fused(x, token, expert, weight, backend)
    gate_up_ref = fused.gate_up_proj.detach().clone().requires_grad_()
    down_ref = fused.down_proj.detach().clone().requires_grad_()
    x_ref, weight_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    y_ref = per_token_reference(x_ref, token, expert, weight_ref, gate_up_ref, down_ref)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    # float64: differences are rounding only; fp32 (triton): ~1e-6 relative after a few sums
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for name, got, want in [
        ("y", y, y_ref),
        ("dx", x.grad, x_ref.grad),
        ("dweight", weight.grad, weight_ref.grad),
        ("dgate_up", fused.gate_up_proj.grad, gate_up_ref.grad),
        ("ddown", fused.down_proj.grad, down_ref.grad),
    ]:
        err = (got - want).abs()
        assert err.max() <= tol * want.abs().max(), f"{name}: max {err.max():.2e} mean {err.mean():.2e}"


def test_fused_equals_split_layout_and_views_share_storage():
    split = SwiGLUExperts(E, D, F).double()
    fused = fused_from(split)
    x = torch.randn(N, D, dtype=torch.float64)
    token, expert = torch.arange(N).repeat_interleave(2), torch.randint(0, E, (2 * N,))
    weight = torch.rand(2 * N, dtype=torch.float64)
    torch.testing.assert_close(fused(x, token, expert, weight), split(x, token, expert, weight), rtol=1e-12, atol=1e-12)
    ptr = fused.gate_up_proj.data_ptr()
    assert fused.w_gate.data_ptr() == ptr and fused.w_up.data_ptr() == ptr + F * D * 8
    assert fused.w_down.data_ptr() == fused.down_proj.data_ptr()
    assert [n for n, _ in fused.named_parameters()] == ["gate_up_proj", "down_proj"]


def test_moe_layer_takes_prebuilt_experts_without_copying():
    experts = FusedSwiGLUExperts(torch.nn.Parameter(torch.randn(E, 2 * F, D)), torch.nn.Parameter(torch.randn(E, D, F)))
    layer = MoELayer(D, F, E, router="topk", top_k=2, experts=experts)
    assert layer.experts is experts and layer.experts.gate_up_proj.data_ptr() == experts.gate_up_proj.data_ptr()
    y = layer(torch.randn(2, 5, D))
    assert y.shape == (2, 5, D)
    with pytest.raises(ValueError, match="d_ff"):
        MoELayer(D, F + 1, E, experts=experts)
    with pytest.raises(ValueError, match="down_proj"):
        FusedSwiGLUExperts(torch.nn.Parameter(torch.randn(E, 2 * F, D)), torch.nn.Parameter(torch.randn(E, F, D)))
