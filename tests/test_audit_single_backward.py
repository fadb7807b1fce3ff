"""A backward that can run once per graph is differentiable: scattermoe's ParallelLinear writes into
the tensors its graph saved (it reuses them as buffers), so a second backward over the same graph
fails its version check. The Jacobian probe's one backward per row over one retained graph then
failed, and the probe read "its graph cannot be differentiated" for a target that trains; it now
gives every row a graph of its own (a fresh forward) and reads the Jacobian."""

from __future__ import annotations

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit


class DoubleReusingItsBuffer(torch.autograd.Function):
    """y = 2 x; its backward writes the incoming gradient into a tensor its graph saved."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(torch.empty_like(x))
        return 2 * x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (buffer,) = ctx.saved_tensors
        buffer.copy_(grad)
        return 2 * buffer


class Block(nn.Module):
    """A per-token map through that function, plus ``leak`` times the sequence's mean."""

    def __init__(self, leak: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.leak = leak

    def forward(self, x: Tensor) -> Tensor:
        return DoubleReusingItsBuffer.apply(self.lin(x)) + self.leak * x.mean(1, keepdim=True)


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


def test_the_case_a_second_backward_over_one_graph_fails():
    x = example().requires_grad_()
    y = Block(0.0)(x)
    torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, x, torch.ones_like(y))


@pytest.mark.parametrize("leak", [0.0, 0.5])
def test_the_jacobian_reads_a_target_whose_backward_runs_once_per_graph(leak):
    report = audit(Block(leak), example(), trials=1)
    for mode in ("train", "eval"):
        probe = report.probe("jacobian", mode)
        assert probe.skipped is None, probe.skipped
        # by hand: the mean gives d y[s] / d x[r] = leak / T at every r > s, so every cut but the last position's moves
        assert probe.leaking_positions == (probe.probed_positions if leak else []), probe
