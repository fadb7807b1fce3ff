"""Selective activation checkpointing keeps the outputs of the matrix products: counted op by
op, a checkpointed block's backward runs no product more than the same block without
checkpointing (the reference), while ``"full"`` runs its forward's products again. And
``checkpoint_mode`` names the mode each block was given.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe.parallel.recompute import apply_activation_checkpointing, checkpoint_mode

aten = torch.ops.aten
PRODUCTS = (aten.bmm.default, aten.mm.default, aten.addmm.default)


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = {op: 0 for op in PRODUCTS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.calls:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    """A batched product and a linear, with elementwise ops around them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.relu(torch.bmm(torch.tanh(x), self.w))).sum()


def products(mode: str) -> dict:
    torch.manual_seed(0)
    block = Block()
    apply_activation_checkpointing([block], mode)
    x = torch.randn(3, 5, 4, requires_grad=True)
    counter = Counting()
    with counter:
        block(x).backward()
    return {str(op): n for op, n in counter.calls.items()}


def test_selective_recomputes_no_product():
    plain = products("none")
    assert plain["aten.bmm.default"] >= 1
    assert products("selective") == plain


def test_full_recomputes_the_products_of_the_forward():
    plain, full = products("none"), products("full")
    assert full["aten.bmm.default"] == plain["aten.bmm.default"] + 1


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_checkpoint_mode_names_the_mode_given(mode):
    block = Block()
    apply_activation_checkpointing([block], mode)
    assert checkpoint_mode(block) == mode
