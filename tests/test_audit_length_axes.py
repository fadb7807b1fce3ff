"""An output is read per position by its leading axes alone, so one whose axis 1 has as many heads
or experts as the example has positions read as per position: x-transformers' Decoder with 16 heads,
audited at T = 16 with return_hiddens=True, returns its attention maps [B, 16, T, T] in a dataclass,
and a causal decoder read as LEAKS in 6 of 12 outputs. The audit now checks, with one shorter
forward, which outputs follow the sequence's length, and lists the others as not per position."""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit


class CausalAttention(nn.Module):
    """One causal attention head per 16 heads of width 1, returning what a block may return beside
    its output: the attention maps [B, H, T, T] (head-major, H = 16) and per-expert counts [B, E] of
    a top-1 choice over E = 16 experts (a statistic of the whole sequence), and one head's weights
    [B, T, T] (per query position: causal)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)
        self.gate = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 16).unbind(2)  # 16 heads of width 1
        scores = torch.einsum("bih,bjh->bhij", q, k)
        maps = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        counts = nn.functional.one_hot(self.gate(x).argmax(-1), 16).sum(1)
        return {"y": torch.einsum("bhij,bjh->bih", maps, v), "maps": maps, "counts": counts, "head0": maps[:, 0]}


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


def test_outputs_whose_axis_1_does_not_follow_the_length_are_not_per_position():
    report = audit(CausalAttention(), example(), trials=1)
    assert not report.leaks, report.summary()
    assert report.outputs == ["y [2, 16, 16]", "head0 [2, 16, 16]"], report.outputs
    skipped = {text.split(" [")[0]: text for text in report.outputs_not_audited}
    assert set(skipped) == {"maps", "counts"}, report.outputs_not_audited
    assert "axis 1 has 16 entries at T=16, not 15 at T=15" in skipped["maps"], skipped["maps"]
    assert report.batch_invariant and report.decode_consistent


def test_the_reading_before_was_a_leak():
    """By hand: the maps' "position" 0 is head 0, whose rows read every later position's key."""
    x, y = example(), example().clone()
    y[:, 8:] = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    out_x, out_y = CausalAttention()(x), CausalAttention()(y)
    assert not torch.equal(out_x["maps"][:, 0], out_y["maps"][:, 0])  # "position" 0 moved
    assert torch.equal(out_x["y"][:, :8], out_y["y"][:, :8])  # the output does not
    assert torch.equal(out_x["head0"][:, :8], out_y["head0"][:, :8])
