"""Routing agreement figures (moe.agreement), the router_dtype option, and the audit's "agreement".

Agreement is checked against hand-made records and against constructions whose answer is known:
logits tied in bf16 but not in fp32, a batch-grouped capacity router (whose drops depend on the
other sequences), expert choice (whose prefix forwards differ from the full forward).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import small_lm
from torch import nn

import moe
from moe.agreement import (
    MARGIN_EDGES,
    PATHS,
    agreement_figures,
    margin_view,
    record_forward,
    routing_agreement,
    score_gaps,
)
from moe.audit import audit
from moe.model import MoETransformer

V = 32


def tiny(router: str, options: dict) -> MoETransformer:
    return small_lm(router, options, vocab_size=V)


def test_agreement_of_two_records_by_hand():
    # 2 sequences x 2 positions x 2 layers; slot order and padding do not matter, the set does
    a = moe.RoutingRecord.from_engine([[[[0, 1], [2, -1]], [[3, 2], [1, 0]]], [[[1, -1], [0, 3]], [[-1, -1], [2, 1]]]])
    b = moe.RoutingRecord.from_engine([[[[1, 0], [2, -1]], [[3, 1], [0, 1]]], [[[1, -1], [3, 0]], [[0, -1], [2, 1]]]])
    # differing (token, layer) pairs: (seq0, pos1, layer0) {2,3} vs {1,3}; (seq1, pos1, layer0) {} vs {0}
    got = routing_agreement(a, b, "a", "b")
    assert (got.share, got.pairs) == (6 / 8, 8)
    assert got.per_layer == [2 / 4, 4 / 4]
    assert got.tokens_all_layers == 2 / 4
    assert got.line().startswith("a vs b: 75.0% of 8 (token, layer) pairs (50.0% of tokens in every layer)")
    with pytest.raises(ValueError, match="different tokens"):
        routing_agreement(a, a.rows(0, 1))


def test_the_largest_expert_id_is_not_an_empty_slot():
    """One token, one layer: {0, 3} against {0} with an empty slot, and {3} against nothing (3 is
    the largest id in either record): both differ; {3, -1} against {3} agrees."""
    for (a, b), same in (([0, 3], [0, -1]), 0.0), (([3], [-1]), 0.0), (([3, -1], [3]), 1.0):
        got = routing_agreement(moe.RoutingRecord.from_engine([[[a]]]), moe.RoutingRecord.from_engine([[[b]]]))
        assert got.share == same, (a, b)


class TiedInBf16(nn.Module):
    """Token ids -> a top-1 router over two experts whose logits 256 + a and 256 + b differ by
    2^-6 in fp32 but round to the same bf16 value (its spacing at 256 is 2): every weight and
    embedding is exact in bf16, so only the precision of the router's own computation decides."""

    def __init__(self, router_dtype: str = "fp32") -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.layer = moe.MoELayer(3, 4, 2, router="topk", top_k=1, router_dtype=router_dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.tensor([[2**-6, 0, 256], [0, 2**-6, 256], [2**-5, 0, 256], [0, 2**-5, 256]]))
            self.layer.router.gate.weight.copy_(torch.tensor([[1.0, 0, 1], [0, 1.0, 1]]))

    def forward(self, idx_BT):
        return self.layer(self.embed(idx_BT))


def test_router_dtype_computes_the_scores_in_the_dtype_it_names():
    x = torch.randn(5, 8).to(torch.bfloat16)
    router = moe.build_router("topk", d_model=8, num_experts=4).to(torch.bfloat16)
    exact = x.double() @ router.gate.weight.double().T  # bf16 inputs multiply exactly in fp64
    fp32 = router.score_logits(x)
    assert fp32.dtype == torch.float32 and (fp32.double() - exact).abs().max() < 1e-5
    router.router_dtype = "fp64"
    assert torch.equal(router.score_logits(x), exact)
    router.router_dtype = "input"
    assert torch.equal(router.score_logits(x), F.linear(x, router.gate.weight))
    # the default leaves an fp32 model's bits as they were, and keeps an fp64 one in fp64
    router32 = moe.build_router("topk", d_model=8, num_experts=4)
    assert torch.equal(router32.score_logits(x.float()), router32.gate(x.float()))
    assert router32.double().score_logits(x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="router_dtype must be one of"):
        moe.build_router("topk", d_model=8, num_experts=4, router_dtype="fp8")
    # hooks on the gate (the trainer's router entropy, the audit) see the logits in the router's dtype
    seen = []
    router.gate.register_forward_hook(lambda _m, _i, logits: seen.append(logits.dtype))
    for dtype in ("fp32", "input"):
        router.router_dtype = dtype
        router(x.view(1, 5, 8))
    assert seen == [torch.float32, torch.bfloat16]


def test_router_dtype_agreement_figure_on_logits_tied_in_bf16():
    idx = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    figures = agreement_figures(TiedInBf16(), idx, paths=("bf16_router", "bf16_model", "bf16_model_fp32_router"))
    # in bf16 both experts score alike, so one of each token pair (truth: expert 0 / expert 1) flips
    assert figures["bf16_router"].share == 0.5 and figures["bf16_model"].share == 0.5
    assert figures["bf16_model_fp32_router"].share == 1.0
    assert figures["bf16_model"].compared == "bf16 weights, router in bf16"
    # the same through the option itself: a bf16 model routes like the fp32 one with the default router
    model = TiedInBf16().to(torch.bfloat16)
    with torch.no_grad():
        fp32_router = record_forward(model, idx)
        model.layer.router.router_dtype = "input"
        bf16_router = record_forward(model, idx)
    reference = record_forward(TiedInBf16(), idx)
    assert routing_agreement(reference, fp32_router).share == 1.0
    assert routing_agreement(reference, bf16_router).share == 0.5


def test_decode_batch_and_chunked_prefill_figures():
    idx = torch.randint(0, V, (3, 12))
    topk = agreement_figures(tiny("topk", {"top_k": 2}), idx, paths=("decode", "batch", "chunked_prefill"))
    assert all(f.share == 1.0 and f.pairs == 3 * 12 * 2 for f in topk.values()), topk
    assert topk["decode"].compared == "KV-cache decoding, one token at a time"
    assert topk["chunked_prefill"].compared == "prefill in chunks of 3"
    leaky = agreement_figures(tiny("expert_choice", {"capacity_factor": 1.0}), idx, paths=("decode", "chunked_prefill"))
    assert leaky["decode"].share < 0.9 and "forward of its prefix" in leaky["decode"].compared
    assert leaky["chunked_prefill"].startswith("no chunked prefill: MoE block 0")
    pooled = tiny("capacity", {"top_k": 2, "capacity_factor": 0.5, "group": "batch", "capacity_scope": "prefix"})
    figures = agreement_figures(pooled, idx, paths=("batch", "chunked_prefill"), chunk=5)
    assert figures["batch"].share < 0.9  # the drops depend on the other sequences ...
    assert figures["chunked_prefill"].share == 1.0  # ... but not on how the prompt is cut
    assert agreement_figures(pooled, idx[:1], paths=("batch",))["batch"].startswith("one sequence")
    with pytest.raises(ValueError, match="unknown agreement paths"):
        agreement_figures(pooled, idx, paths=("fp8",))


def test_a_gap_on_an_edge_opens_its_bin_and_the_default_chunk_rounds_up():
    """Bins are [low, high): gaps of exactly 0, 1e-4, 1e-3, 1e-2 and 0.1 each open their own bin.
    Six positions prefill in chunks of ceil(6 / 4) = 2 by default; two positions in chunks of 1."""
    record = moe.RoutingRecord.from_engine([[[[0]]] * 6])
    gaps_NL = torch.tensor([[0.0], [1e-4], [1e-3], [1e-2], [0.1], [7.0]], dtype=torch.float64)
    assert margin_view(routing_agreement(record, record), gaps_NL)["pairs"] == [[1, 1, 1, 1, 2]]
    assert MARGIN_EDGES[1:5] == (1e-4, 1e-3, 1e-2, 1e-1)
    model = small_lm("topk", {"top_k": 2}, vocab_size=V)
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
    assert (
        agreement_figures(model, idx, paths=("chunked_prefill",))["chunked_prefill"].compared
        == "prefill in chunks of 2"
    )
    short = agreement_figures(model, idx[:, :2], paths=("chunked_prefill",))["chunked_prefill"]
    assert short.compared == "KV-cache decoding, one token at a time" and short.share == 1.0


def test_figures_run_in_eval_mode_and_a_top_k_of_every_expert_has_no_margin():
    """A model in training mode is measured in eval mode and left in training mode. A router whose
    top_k is its number of experts has no (k+1)-th score: no gaps, no margin view."""
    model = small_lm("topk", {"top_k": 4}, vocab_size=V)  # small_lm: 4 experts
    assert model.training
    modes = []

    def forward(m, idx_BT):
        modes.append(m.training)
        return m(idx_BT)

    idx = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    figures = agreement_figures(model, idx, paths=("batch",), forward=forward)
    assert modes and not any(modes) and model.training
    assert score_gaps(model, idx) is None and figures["batch"].margin is None


def test_a_bf16_model_is_compared_with_its_fp32_copy():
    """Given a bf16 model whose router computes in the input's dtype, the precision figures'
    reference is the fp32 copy (distinct scores): the bf16 router flips one of each pair as it does
    for the fp32 model, the fp32 router flips none."""
    idx = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    model = TiedInBf16(router_dtype="input").to(torch.bfloat16)
    figures = agreement_figures(model, idx, paths=("bf16_router", "bf16_model_fp32_router"))
    assert figures["bf16_router"].share == 0.5 and figures["bf16_model_fp32_router"].share == 1.0
    assert model.layer.router.gate.weight.dtype == torch.bfloat16


def test_the_audit_reports_agreement_for_model_targets_only():
    report = audit(tiny("topk", {"top_k": 2}), torch.randint(0, V, (2, 6)), modes=("eval",), trials=1)
    assert sorted(report.agreement) == sorted(PATHS)
    assert report.agreement["decode"]["share"] == 1.0 and report.agreement["decode"]["pairs"] == 24
    assert json.loads(report.to_json())["targets"][0]["agreement"] == report.agreement
    summary = report.summary()
    assert "routing agreement (eval; share of (token, layer) pairs routed to the same expert set):" in summary
    assert (
        "  decode: 100.0% of 24 pairs (100.0% of tokens in every layer): full forward vs KV-cache decoding" in summary
    )
    router = moe.build_router("topk", d_model=8, num_experts=4)
    assert audit(router, torch.randn(2, 6, 8), modes=("eval",), trials=1).agreement is None
    quiet = audit(tiny("topk", {}), torch.randint(0, V, (2, 6)), modes=("eval",), trials=1, agreement=False)
    assert quiet.agreement is None and "routing agreement" not in quiet.summary()


def test_router_dtype_is_a_router_option_of_the_model_and_the_trainer():
    from moe.training import config_from_args, model_config

    cfg = config_from_args(["--router", "topk", "--router-option", "router_dtype=fp64", "--steps", "1"])
    model = MoETransformer(model_config(cfg.model, V))
    assert [r.router_dtype for r in model.routers()] == ["fp64"] * model.cfg.n_layers
    assert MoETransformer(model_config(config_from_args(["--steps", "1"]).model, V)).routers()[0].router_dtype == "fp32"
    with pytest.raises(ValueError, match="router_dtype must be one of"):
        config_from_args(["--router-option", "router_dtype=fp8", "--steps", "1"])
