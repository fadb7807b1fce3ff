"""A backward that hands out a gradient of its own is no leak: DeepSeek-MoE's AddAuxiliaryLoss
(feizc/DiT-MoE, DeepSeek-MoE's modelling code) and Megatron-Core's MoEAuxLossAutoScaler pass the
output through and give an auxiliary loss, a statistic of the whole batch, a gradient of ones in
backward, so autograd's d output[s] / d input has a part at every position that no output value
has. The Jacobian probe subtracts the gradient a zero output gradient gets (the product is linear
in it) and says so; DiT-MoE's causal block read as LEAKS in training before."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.audit import audit


class AddAuxiliaryLoss(torch.autograd.Function):
    """y = x; in backward, x's gradient passes through and the loss gets 1."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor]:
        return grad_output, torch.ones((), dtype=grad_output.dtype, device=grad_output.device)


class PerTokenWithAux(nn.Module):
    """A per-token map whose training forward attaches a load-balancing-like loss over the batch;
    ``leak`` adds that much of the sequence's mean to every position (a real leak)."""

    def __init__(self, leak: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.leak = leak
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x) + self.leak * x.mean(1, keepdim=True)
        if self.training:
            aux = 0.01 * (self.lin(x).softmax(-1).mean(dim=(0, 1)) ** 2).sum()
            y = AddAuxiliaryLoss.apply(y, aux)
        return y


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


def test_a_gradient_the_backward_adds_is_subtracted_and_named():
    x = example().requires_grad_()
    (g,) = torch.autograd.grad(PerTokenWithAux().train()(x)[0, 3].sum(), x)
    assert g[0, 4:].abs().max() > 0  # the case: autograd's product reaches later positions
    report = audit(PerTokenWithAux(), example())
    assert not report.leaks, report.summary()
    assert report.probe("jacobian", "train").note.startswith("its backward adds a gradient of its own")
    assert report.probe("jacobian", "eval").note is None
    assert "jacobian/train: its backward adds a gradient of its own" in report.summary()


def test_a_real_leak_beside_the_added_gradient_is_still_read_by_the_jacobian():
    report = audit(PerTokenWithAux(leak=1e-3), example(), modes=("train",))
    jacobian = report.probe("jacobian", "train")
    assert jacobian.leaks and jacobian.leaking_positions == list(range(15)), report.summary()
