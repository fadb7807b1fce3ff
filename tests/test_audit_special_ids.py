"""Token ids a model treats specially, put in the future on purpose: the smallest and largest id,
ids the user names, and the example's own ids. On main 1de3896 futures held uniform random ids
and copies of the past, so a block that packs documents split at an end-of-document id (a
leak only an end-of-document id in the future triggers) was reported clean in both modes.

The block here is written the way pre-training code packs documents: every row holds several
documents, each ended by an end-of-document id; each document gets its own expert capacity,
sized from its length, slots taken in position order. While a document runs on to the end of
the row nothing later changes its earlier tokens; an end-of-document id after position t ends the
document there, its capacity shrinks, and tokens at or before t are dropped.

Shapes: B=4, T=16, D=16, E=4, a vocabulary of 32000 ids (uniform random ids almost never hit
one given id).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import AuditUsageError, audit, cli

B, T, D, E, V = 4, 16, 16, 4, 32000
SEEDS = range(3)


class PackedDocumentMoE(nn.Module):
    """Token ids -> hidden states of one MoE block over packed documents (see the module
    docstring). Top-1 routing; ``per_document=False`` gives the whole row one capacity (no
    document split: the control, causal whatever the ids)."""

    def __init__(self, eod_id: int, seed: int = 0, capacity_factor: float = 1.0, per_document: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, D, 2 * D) / math.sqrt(D))
        self.w_out = nn.Parameter(torch.randn(E, 2 * D, D) / math.sqrt(2 * D))
        self.eod_id, self.capacity_factor, self.per_document = eod_id, capacity_factor, per_document

    def forward(self, input_ids: Tensor) -> Tensor:
        b, t = input_ids.shape
        h_BTD = self.embed(input_ids)
        weight_BT, expert_BT = self.gate(h_BTD).softmax(-1).max(-1)
        eod_BT = (input_ids == self.eod_id).long() if self.per_document else torch.zeros_like(input_ids)
        doc_BT = eod_BT.cumsum(1) - eod_BT  # an end-of-document id belongs to the document it ends
        same_doc_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
        capacity_BT = torch.ceil(self.capacity_factor * same_doc_BTT.sum(-1) / E)
        earlier_BTT = same_doc_BTT & torch.ones(t, t, dtype=torch.bool).tril()
        onehot_BTE = F.one_hot(expert_BT, E).float()
        slot_BT = (earlier_BTT.float() @ onehot_BTE).gather(-1, expert_BT[..., None])[..., 0]
        kept_BT = slot_BT <= capacity_BT
        hidden_BTF = torch.einsum("btd,btdf->btf", h_BTD, self.w_in[expert_BT]).relu()
        y_BTD = torch.einsum("btf,btfd->btd", hidden_BTF, self.w_out[expert_BT])
        return h_BTD + (weight_BT * kept_BT)[..., None] * y_BTD


def ids(seed: int, low: int = 3, high: int = V - 1) -> Tensor:
    """Random ids in [low, high): none of the special ids used below."""
    return torch.randint(low, high, (B, T), generator=torch.Generator().manual_seed(seed))


def _found_by_ids(report, *wanted: int) -> bool:
    return any(f"id = {i} " in (p.found_by or "") for p in report.probes for i in wanted)


def test_the_leak_is_real():
    """An end-of-document id right after position 8 drops tokens at or before 8 (and only then)."""
    for seed in SEEDS:
        block, x = PackedDocumentMoE(V - 1, seed), ids(seed)
        y = x.clone()
        y[:, 9] = V - 1
        with torch.no_grad():
            moved = (block(x)[:, :9] - block(y)[:, :9]).abs().amax()
            causal = PackedDocumentMoE(V - 1, seed, per_document=False)
            unmoved = (causal(x)[:, :9] - causal(y)[:, :9]).abs().amax()
        assert moved > 0.1 and unmoved == 0, (float(moved), float(unmoved))


def test_an_end_of_document_id_at_the_end_of_the_vocabulary_is_found():
    """GPT-2 style: the end-of-text id is the largest id. The example holds none of it."""
    for seed in SEEDS:
        report = audit(PackedDocumentMoE(V - 1, seed), ids(seed), seed=seed, name="packed")
        assert report.leaks_in == ["train", "eval"], report.table()
        assert _found_by_ids(report, V - 1), report.table()
        assert report.ids_tried["smallest"] == [0] and report.ids_tried["largest"] == [V - 1], report.ids_tried
        summary = report.summary()
        assert f"token ids put in futures: 0 (smallest); {V - 1} (largest);" in summary, summary


def test_a_named_end_of_document_id_is_found_and_an_unnamed_one_is_a_stated_limit():
    """Llama style: the end-of-sequence id is 2, neither end of the vocabulary nor in the example:
    found once named; unnamed, the report says which ids were tried, so the reader sees 2 was not."""
    for seed in SEEDS:
        named = audit(PackedDocumentMoE(2, seed), ids(seed), seed=seed, special_ids=[2])
        assert named.leaks_in == ["train", "eval"] and _found_by_ids(named, 2), named.table()
        assert named.ids_tried["named"] == [2], named.ids_tried
    unnamed = audit(PackedDocumentMoE(2, 0), ids(0), modes=("eval",))
    assert not unnamed.leaks and 2 not in sum(unnamed.ids_tried.values(), []), unnamed.table()
    assert "and uniform random ids" in unnamed.summary(), unnamed.summary()


def test_an_id_of_the_example_is_tried_in_every_future():
    """Real data holds its separators: here the example holds id 7 once, at the last position of
    a row (a document that ends with the row, so resampling the future never removes a split)."""
    for seed in SEEDS:
        x = ids(seed, low=8)
        x[B - 1, T - 1] = 7
        report = audit(PackedDocumentMoE(7, seed), x, seed=seed)
        assert report.leaks_in == ["train", "eval"], report.table()
        assert 7 in report.ids_tried["the example's own"], report.ids_tried
        assert any("the example's ids" in (p.found_by or "") for p in report.probes), report.table()


def test_a_causal_block_stays_clean_with_every_special_id():
    for seed in SEEDS:
        x = ids(seed)
        x[0, 3] = 7
        report = audit(PackedDocumentMoE(7, seed, per_document=False), x, seed=seed, special_ids=[2, 7])
        assert report.error is None and not report.leaks, report.table()


def test_special_ids_usage_errors():
    with pytest.raises(AuditUsageError, match=r"special ids must lie in \[0, 32000\), got \[32000\]"):
        audit(PackedDocumentMoE(2), ids(0), special_ids=[V])
    with pytest.raises(AuditUsageError, match="token inputs only"):
        audit(nn.Identity(), torch.randn(B, T, D), special_ids=[1])


def test_cli_special_ids(tmp_path, capsys):
    file = tmp_path / "packed.py"
    file.write_text(
        f"import sys\nsys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})\n"
        "from test_audit_special_ids import PackedDocumentMoE\n\n"
        "def build():\n    return PackedDocumentMoE(2)\n"
    )
    argv = ["--target", f"{file}:build", "--input", f"tokens:{B},{T},{V}", "--modes", "eval", "--no-progress"]
    assert cli.main([*argv, "--special-ids", "2"]) == 1
    assert "token ids put in futures: 0 (smallest); 31999 (largest); 2 (named)" in capsys.readouterr().out
    for bad, message in (("two", "comma-separated integers"), ("40000", "must lie in [0, 32000)")):
        assert cli.main([*argv, "--special-ids", bad]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
