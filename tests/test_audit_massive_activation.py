"""Tolerances at the scale of what is compared: a massive activation must not hide a leak.

Real LLMs carry a few activations thousands of times larger than the rest, at the first
position and a handful of features (Sun et al. 2024, "Massive Activations in Large Language
Models", arXiv 2402.17762). The target here is a residual block over such a stream, written
from that description: one entry of MASSIVE at position 0, feature 0, then an MoE update of
small experts under top-1 routing with a capacity per sequence whose slots go to the highest
scores (score priority: a later token with a higher score takes an earlier token's slot). A
dropped token loses its update, so the leak moves entries of size ~1 by ~0.01, below 100 ulp
of the massive entry (0.036) but ~1000 times 100 ulp of the entries it moves.

Shapes: B=4, T=32, D=16, E=4 experts, capacity T / E = 8 per expert and sequence.
"""

from __future__ import annotations

import math

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit

B, T, D, E = 4, 32, 16, 4
MASSIVE = 3000.0
UPDATE = 0.02
"""The experts' updates are UPDATE * tanh(...): at most 0.02 per entry, as residual updates are
small beside the stream they are added to."""
OLD_FLOOR = 100 * torch.finfo(torch.float32).eps * MASSIVE
"""100 ulp of the largest |output|: the tolerance before (main 1599c4c), 0.036."""


class MassiveResidualBlock(nn.Module):
    """h = x with h[:, 0, 0] += massive; y = h + p * expert(norm(h)) for kept tokens. ``priority``:
    "score" keeps each expert's CAPACITY highest-scoring tokens of the sequence (leaks), "none"
    keeps every token (dropless: causal)."""

    def __init__(self, massive: float = MASSIVE, priority: str = "score") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate = nn.Parameter(torch.randn(E, D, generator=gen))
        self.experts = nn.Parameter(torch.randn(E, D, D, generator=gen) / math.sqrt(D))
        self.massive, self.priority = massive, priority

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, _ = x_BTD.shape
        h_BTD = x_BTD.clone()
        h_BTD[:, 0, 0] = h_BTD[:, 0, 0] + self.massive
        n_BTD = h_BTD * torch.rsqrt(h_BTD.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits_BTE = n_BTD @ self.gate.T
        p_BT, expert_BT = logits_BTE.softmax(-1).max(-1)
        keep_BT = torch.ones(b, t, dtype=torch.bool)
        if self.priority == "score":
            capacity = max(1, t // E)
            score_BT = logits_BTE.gather(-1, expert_BT[..., None])[..., 0]
            keep_BT = torch.zeros(b, t, dtype=torch.bool)
            for e in range(E):
                mine_BT = expert_BT == e
                top_BC = torch.where(mine_BT, score_BT, -math.inf).topk(min(capacity, t), dim=1).indices
                keep_BT.scatter_(1, top_BC, mine_BT.gather(1, top_BC) | keep_BT.gather(1, top_BC))
        update_BTD = UPDATE * torch.tanh(torch.einsum("btd,btde->bte", n_BTD, self.experts[expert_BT]))
        return h_BTD + update_BTD * (p_BT * keep_BT)[..., None]


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_the_leak_is_real_and_below_the_old_floor():
    """The reference, without the audit: futures resampled at a few cuts move earlier entries of
    size ~1 by 0.005 to 0.02, while the output holds an entry of 3000."""
    block, x = MassiveResidualBlock(), example()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        y = block(x)
        moved = 0.0
        for cut in (3, 11, 19):
            v = x.clone()
            v[:, cut + 1 :] = torch.randn(B, T - cut - 1, D, generator=gen)
            moved = max(moved, float((block(v) - y)[:, : cut + 1].abs().max()))
    assert float(y.abs().max()) > MASSIVE - 10
    assert 0.005 < moved < OLD_FLOOR, f"the planted leak moves entries by {moved:.4f}"


def test_a_massive_activation_does_not_hide_a_capacity_leak():
    report = audit(MassiveResidualBlock(), example(), name="massive")
    assert report.leaks_in == ["train", "eval"], report.summary()
    for mode in ("train", "eval"):
        p = report.probe("random_future", mode)
        # A change the old floor hid, ~1000x over the tolerance at the scale of its entry.
        assert p.leaks and p.max_abs_delta < OLD_FLOOR and p.excess > 100, report.table()
        assert p.first_leaking_position == 0, report.table()
    # The same block without the massive entry leaks alike: the probes see it either way.
    assert audit(MassiveResidualBlock(massive=0.0), example()).leaks_in == ["train", "eval"]


def test_a_massive_activation_in_a_causal_block_is_clean():
    """Dropless, the same block is causal, batch-invariant and decode-consistent: rounding around
    the 3000 entry (batches and prefixes of other shapes) must count at that entry's scale."""
    report = audit(MassiveResidualBlock(priority="none"), example(), name="massive dropless")
    assert report.leaks_in == [] and report.batch_invariant and report.decode_consistent, report.summary()
