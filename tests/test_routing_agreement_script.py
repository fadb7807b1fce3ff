"""experiments/routing_agreement.py end to end at the quick size: one router trained with the
router study's row config, its paths measured, JSON and markdown written."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import routing_agreement  # noqa: E402


@pytest.mark.slow
def test_quick_run_trains_measures_and_replays_the_served_routing(tmp_path):
    common = ["--routers", "topk_aux", "expert_choice", "--workers", "1", "--runs", str(tmp_path / "runs")]
    routing_agreement.main(["--quick", "train", *common])
    out = tmp_path / "agreement.json"
    result = routing_agreement.main(
        ["--quick", "measure", *common, "--windows", "8", "--batch-size", "8", "--json", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    topk, ec = result["rows"]
    assert topk["decoding"] == "KV-cache decoding, one token at a time" and "prefix" in ec["decoding"]
    assert topk["agreement"]["fp32_tf_vs_fp32_decode"]["share"] == 1.0  # causal and decode-consistent
    assert ec["agreement"]["fp32_tf_vs_fp32_decode"]["share"] < 0.9  # expert choice leaks
    for row in result["rows"]:
        for name in routing_agreement.BF16_PATHS:  # the replayed trainer routes exactly what was served
            assert row["agreement"][f"replayed_vs_{name}_decode"]["share"] == 1.0
        assert row["agreement"]["fp32_tf_vs_fp32_decode"]["pairs"] == 8 * 32 * 2  # windows x positions x layers
        # the training run's own final evaluation (the same 8 windows): the exported model is the trained one
        assert row["training"]["causal_loss"] == pytest.approx(row["loss"]["fp32_decode"], abs=1e-5)
        assert row["training"]["teacher_forced_loss"] == pytest.approx(row["loss"]["fp32_tf"], abs=1e-5)
    # replaying expert choice's causal routing brings the trainer to what decoding served
    gap = ec["logprob_gap"]
    assert gap["fp32_replay_bf16_vs_bf16_decode"][0] < gap["fp32_tf_vs_bf16_decode"][0]
    table, margins = out.with_suffix(".md").read_text().split("\nMargin view", 1)
    assert table.count("| topk_aux |") == 2 and table.count("| expert_choice |") == 2
    # the margin tables: top-k's every (token, layer) pair in one gap bin; expert choice has no k-th score
    assert [sum(p) for p in topk["margin"]["fp32_decode_vs_bf16_decode"]["pairs"]] == [8 * 32] * 2
    assert ec["margin"] == {} and margins.count("| topk_aux | 1 |") == 2 and "expert_choice" not in margins


def test_the_margin_table_spreads_the_bf16_flips_over_the_gap_bins():
    """measure_batch's margin views, merged over two batches, against a per-pair count: the fp64
    gate logits' k-th minus (k+1)-th score binned by hand, a pair flipped where the fp32 and the bf16
    decodings' expert sets differ."""
    import torch
    from helpers import small_lm

    from moe.agreement import MARGIN_EDGES, cast_parameters, router_dtype, run_decoding

    model = small_lm("topk", {"top_k": 2}, vocab_size=64).eval()
    idx_BT = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    views = [routing_agreement.measure_batch(model, idx_BT[i : i + 4])["margin"] for i in (0, 4)]
    merged = routing_agreement.merge_margins([v["fp32_decode_vs_bf16_decode"] for v in views])

    logits = []
    hooks = [r.gate.register_forward_hook(lambda m, a, out: logits.append(out.double())) for r in model.routers()]
    with torch.no_grad():
        model(idx_BT)
    for h in hooks:
        h.remove()
    fp32 = run_decoding(model, idx_BT).record.experts
    half = cast_parameters(model, torch.bfloat16)
    with router_dtype(half, "input"):
        bf16 = run_decoding(half, idx_BT).record.experts
    pairs = [[0] * (len(MARGIN_EDGES) - 1) for _ in logits]
    flipped = [[0] * (len(MARGIN_EDGES) - 1) for _ in logits]
    for layer, logits_NE in enumerate(logits):
        for n, row in enumerate(logits_NE.tolist()):
            ranked = sorted(row, reverse=True)
            gap = ranked[1] - ranked[2]
            b = max(i for i, edge in enumerate(MARGIN_EDGES[:-1]) if gap >= edge)
            t, s = divmod(n, idx_BT.shape[1])
            pairs[layer][b] += 1
            flipped[layer][b] += set(fp32[t, s, layer].tolist()) != set(bf16[t, s, layer].tolist())
    assert merged["pairs"] == pairs and merged["flipped"] == flipped
    assert sum(map(sum, flipped)) > 0  # bf16 moved some pairs: the table has flips to place

    row = {
        "router": "topk_aux",
        "margin": {"fp32_decode_vs_bf16_decode": merged, "fp32_decode_vs_bf16_fp32_router_decode": merged},
    }
    lines = routing_agreement.margin_lines([row, {"router": "ec_threshold", "margin": {}}])
    layer0 = [line for line in lines if line.startswith("| topk_aux | 0 |")]
    total = sum(flipped[0])
    cells = [f"{100 * f / max(total, 1):.0f}% ({f}/{n})" for f, n in zip(flipped[0], pairs[0])]
    assert layer0 == ["| topk_aux | 0 | " + " | ".join(cells) + f" | {total} |"] * 2
    assert not any("ec_threshold" in line for line in lines)


def test_batches_merge_into_the_agreement_of_the_whole_and_margins_count_their_flips():
    """merge() of a batch of two windows and a short one of one is routing_agreement of all three
    windows at once (share, per layer, tokens in every layer: pair-weighted, so the short batch
    counts for its size), and its standard error the sample standard deviation of the windows'
    shares over sqrt(3); mean_se likewise. merge_margins turns each bin's flip share back into a
    count: 15 of 22 pairs (15/22 * 22 is 14.999... in float64) are 15 flips."""
    import math

    import torch

    from moe.agreement import routing_agreement as agreement
    from moe.record import RoutingRecord

    g = torch.Generator().manual_seed(0)
    a_BSLK, b_BSLK = (torch.randint(0, 3, (3, 5, 2, 1), generator=g) for _ in range(2))
    a, b = RoutingRecord(2, a_BSLK), RoutingRecord(2, b_BSLK)
    parts = [routing_agreement.compare(a.rows(i, j), b.rows(i, j)) for i, j in ((0, 2), (2, 3))]
    merged, whole = routing_agreement.merge(parts), agreement(a, b)
    assert 0 < whole.share < 1 and whole.per_layer[0] != whole.per_layer[1]
    assert merged["pairs"] == whole.pairs == 3 * 5 * 2
    assert merged["share"] == pytest.approx(whole.share, abs=1e-12)
    assert merged["per_layer"] == pytest.approx(whole.per_layer, abs=1e-12)
    assert merged["tokens_all_layers"] == pytest.approx(whole.tokens_all_layers, abs=1e-12)
    shares = [agreement(a.rows(i, i + 1), b.rows(i, i + 1)).share for i in range(3)]
    mean = sum(shares) / 3
    sd = math.sqrt(sum((s - mean) ** 2 for s in shares) / 2)
    assert merged["share_se"] == pytest.approx(sd / math.sqrt(3), rel=1e-12)
    values = torch.tensor([1.0, 2.0, 4.0, 9.0], dtype=torch.float64)  # mean 4, sample variance (9 + 4 + 0 + 25) / 3
    assert routing_agreement.mean_se(values) == pytest.approx([4.0, math.sqrt(38 / 3) / 2], rel=1e-12)

    view = {"edges": [0.0, 1.0, math.inf], "pairs": [[22, 49]], "flip_share": [[15 / 22, 1 / 49]]}
    assert routing_agreement.merge_margins([view, view]) == {
        "edges": [0.0, 1.0, math.inf],
        "pairs": [[44, 98]],
        "flipped": [[30, 2]],
    }
