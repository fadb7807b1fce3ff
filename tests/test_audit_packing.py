"""The audit's own packing of perturbed copies adapts to the target. On main 1de3896 every
batch-invariant target got packs of 512 samples; a GShard-style block whose dense dispatch grows
with the square of its token count ran past the per-forward time limit on such a pack and was
reported NOT AUDITED (exit 2) although one forward of the user's input takes milliseconds.

Shapes: B=4, T=16, D=32, E=4.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit
from moe.audit.comparator import MAX_ROWS, PACK_SECONDS, Packer

B, T, D, E = 4, 16, 32, 4


class DenseDispatchTop1(nn.Module):
    """Top-1 routing with a dense one-hot dispatch tensor [N, E, C], slots counted by a
    cumulative sum over the flattened batch, as GShard-era code wrote it: its memory and time
    grow with N^2 (C is proportional to N). ``capacity_factor`` 4 makes C = N: no token is ever
    dropped, so the block is causal and batch-invariant."""

    def __init__(self, seed: int = 0, capacity_factor: float = 4.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / math.sqrt(D))
        self.capacity_factor = capacity_factor

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(-1, d)
        n = x_ND.shape[0]
        capacity = math.ceil(self.capacity_factor * n / E)
        probs_NE = self.gate(x_ND).softmax(-1)
        mask_NE = nn.functional.one_hot(probs_NE.argmax(-1), E).to(x_ND.dtype)
        slot_NE = (mask_NE.cumsum(0) - 1) * mask_NE
        kept_NE = mask_NE * (slot_NE < capacity)
        dispatch_NEC = kept_NE[..., None] * nn.functional.one_hot(slot_NE.long().clamp_max(capacity - 1), capacity)
        expert_in_ECD = torch.einsum("nec,nd->ecd", dispatch_NEC, x_ND)
        expert_out_ECD = torch.tanh(torch.einsum("ecd,edf->ecf", expert_in_ECD, self.w_EDD))
        combine_NEC = dispatch_NEC * probs_NE[..., None]
        return torch.einsum("nec,ecd->nd", combine_NEC, expert_out_ECD).reshape(b, t, d)


def test_a_quadratic_block_is_audited_without_packs_that_time_out():
    """One forward of [4, 16, 32] takes a few ms; 1de3896's pack of 128 copies (8192 tokens, a
    268 MB dispatch tensor) did not return within the limit."""
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    report = audit(DenseDispatchTop1(), x, forward_timeout=2.0)
    assert report.error is None, report.error
    assert not report.leaks and report.batch_invariant, report.table()


@pytest.mark.parametrize("timeout", [None, 60.0])
def test_the_pack_grows_with_a_linear_cost_and_never_with_a_quadratic_one(timeout):
    """The packing policy on stated timings (seconds per forward of k copies of the example)."""
    one = 1e-3
    overhead = Packer(B, B * T * D, one, timeout)
    assert overhead.start(pair_s=1.1 * one, one_s=one) and overhead.size == 8  # mostly per-call overhead
    linear = Packer(B, B * T * D, one, timeout)
    assert linear.start(pair_s=1.9 * one, one_s=one) and linear.size == 4
    for _ in range(6):
        copies = linear.size
        linear.observe(copies, one * (0.5 + 0.5 * copies))  # a fixed overhead, then linear work
    assert linear.size == MAX_ROWS // B, linear.size
    quadratic = Packer(B, B * T * D, one, timeout)
    assert not quadratic.start(pair_s=4 * one, one_s=one) and quadratic.size == 1 and not quadratic.packs


def test_one_slow_forward_neither_stops_nor_shrinks_packing():
    """Decisions read the fastest time seen at a size: a forward that a busy machine stretched at
    a size already seen fast changes nothing; one at a new size halves the pack, which regrows."""
    one = 1e-3
    packer = Packer(B, B * T * D, one, None)
    assert packer.start(pair_s=1.9 * one, one_s=one) and packer.size == 4
    for copies, ms in ((4, 2.5), (8, 3.0), (16, 4.0)):
        packer.observe(copies, ms * one)
    assert packer.size == 32, packer.size
    packer.observe(32, 200 * one)  # the first forward of 32 copies, stretched: halved
    assert packer.size == 16, packer.size
    packer.observe(16, 60 * one)  # stretched, but 16 copies were seen to take 3 ms: grows again
    assert packer.size == 32, packer.size
    packer.observe(32, 5 * one)
    assert packer.size == 64, packer.size
    packer.observe(64, PACK_SECONDS * 2)  # past the cap: smaller packs
    assert packer.size == 32, packer.size
