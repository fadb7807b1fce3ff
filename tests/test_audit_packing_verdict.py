"""A verdict that never depends on whether perturbed copies shared a forward. On 7dc4c10 a block
whose expert capacity is sized from the longest document in the batch (documents split at an
end-of-document id) was called clean in two runs and leaking in eval mode only in a third: its
batch probes never put the end-of-document id in a sample, so it was packed, and in a pack the
example's own long documents, riding along as copy 0, kept the capacity up for every copy; how
much was packed depended on the machine's load.

Shapes: B=4, T=16, D=16, E=4, a vocabulary of 1000 ids, end-of-document id 999.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit
from moe.audit.comparator import Packer, Variant
from moe.audit.probes import Probe, registered_probes

B, T, D, E, V = 4, 16, 16, 4, 1000
EOD = V - 1


class LongestDocumentCapacity(nn.Module):
    """Token ids -> hidden states of a top-1 MoE block over packed documents whose capacity per
    expert is sized once per batch from its longest document (``capacity_factor * longest / E``,
    as code that pads every document to the longest one sizes its buffers), slots taken in
    position order within each sequence. While the longest document runs to the end of a row,
    nothing later changes an earlier token; an end-of-document id after position t in every row
    shortens the longest document, the capacity shrinks and tokens at or before t are dropped.
    The batch is coupled: another row's longest document sizes this row's capacity."""

    def __init__(self, seed: int = 0, capacity_factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / math.sqrt(D))
        self.capacity_factor = capacity_factor

    def forward(self, input_ids: Tensor) -> Tensor:
        h_BTD = self.embed(input_ids)
        weight_BT, expert_BT = self.gate(h_BTD).softmax(-1).max(-1)
        eod_BT = (input_ids == EOD).long()
        doc_BT = eod_BT.cumsum(1) - eod_BT
        lengths = F.one_hot(doc_BT, input_ids.shape[1]).sum(1)  # [B, documents]
        capacity = math.ceil(self.capacity_factor * int(lengths.max()) / E)
        slot_BT = (F.one_hot(expert_BT, E).cumsum(1) * F.one_hot(expert_BT, E)).sum(-1)
        kept_BT = slot_BT <= capacity
        y_BTD = torch.tanh(torch.einsum("btd,btde->bte", h_BTD, self.w_EDD[expert_BT]))
        return h_BTD + (weight_BT * kept_BT)[..., None] * y_BTD


def example(seed: int = 0) -> Tensor:
    return torch.randint(1, V - 1, (B, T), generator=torch.Generator().manual_seed(seed))


def _forced(monkeypatch, pack: bool) -> None:
    """The packer's timing decision forced: packs of 8 copies from the start, or none."""

    def start(self: Packer, pair_s: float, one_s: float) -> bool:
        self.size = min(self.limit, 8) if pack else 1
        return self.packs

    monkeypatch.setattr(Packer, "start", start)
    monkeypatch.setattr(Packer, "observe", lambda self, copies, seconds: None)


@pytest.mark.parametrize("pack", [True, False])
def test_the_verdict_is_the_same_whether_the_timings_say_pack_or_not(monkeypatch, pack):
    _forced(monkeypatch, pack)
    report = audit(LongestDocumentCapacity(), example(), special_ids=[EOD])
    assert report.error is None and report.leaks_in == ["train", "eval"], report.summary()
    assert not report.batch_invariant, report.summary()


class ShortestDocumentCapacity(LongestDocumentCapacity):
    """The same block with its capacity sized from the batch's shortest document: an
    end-of-document id in another copy of a pack shrinks the capacity of the example's copy."""

    def forward(self, input_ids: Tensor) -> Tensor:
        eod_BT = (input_ids == EOD).long()
        doc_BT = eod_BT.cumsum(1) - eod_BT
        lengths = F.one_hot(doc_BT, input_ids.shape[1]).sum(1)
        shortest = int(lengths[lengths > 0].min())
        h_BTD = self.embed(input_ids)
        weight_BT, expert_BT = self.gate(h_BTD).softmax(-1).max(-1)
        slot_BT = (F.one_hot(expert_BT, E).cumsum(1) * F.one_hot(expert_BT, E)).sum(-1)
        kept_BT = slot_BT <= math.ceil(shortest / E)
        y_BTD = torch.tanh(torch.einsum("btd,btde->bte", h_BTD, self.w_EDD[expert_BT]))
        return h_BTD + (weight_BT * kept_BT)[..., None] * y_BTD


def test_a_pack_that_moves_the_examples_own_copy_ends_packing(monkeypatch):
    """With a batch probe that finds nothing, packing starts; the first pack whose example copy
    moved (an end-of-document id in another copy) ends it, and the variants run one by one."""
    _forced(monkeypatch, pack=True)
    idle = Probe("same_batch", "batch", variants=lambda ctx: [Variant(ctx.x, ctx.t, rows=(0,), label="itself")])
    probes = [p for p in registered_probes() if p.kind == "future"] + [idle]
    report = audit(ShortestDocumentCapacity(), example(), modes=("eval",), special_ids=[EOD], probes=probes)
    assert report.leaks_in == ["eval"], report.summary()
    assert any("stopped sharing forwards" in n for n in report.notes), report.notes
