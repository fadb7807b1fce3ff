"""moe.agreement's figures against references written out here: the agreement of two hand-made
records (a token agrees in every layer only if each of its layers agrees), the margin view's
per-bin flip shares, and the gap between the k-th and (k+1)-th gate logit from the gate's own
output sorted by hand."""

import math

import pytest
import torch
from helpers import assignments, small_lm

import moe
from moe.agreement import MARGIN_EDGES, margin_view, routing_agreement, run_prefixes, score_gaps
from moe.record import RoutingRecord

# [B=1, S=4, L=2, K=2]; -1 an empty slot. Token 0 agrees in both layers (slots in another order),
# token 1 only in layer 0, token 2 only in layer 1, token 3 in neither.
A = [[[0, 1], [2, 3]], [[1, 2], [0, -1]], [[3, 0], [1, 2]], [[0, 2], [3, -1]]]
B = [[[1, 0], [3, 2]], [[2, 1], [1, -1]], [[3, 1], [2, 1]], [[0, 3], [2, -1]]]


def record(rows) -> RoutingRecord:
    return RoutingRecord(2, torch.tensor([rows], dtype=torch.int32))


def test_agreement_of_hand_records_is_the_set_comparison_by_hand():
    same = [[set(a[layer]) - {-1} == set(b[layer]) - {-1} for layer in range(2)] for a, b in zip(A, B)]
    got = routing_agreement(record(A), record(B))
    assert got.same_NL.tolist() == same == [[True, True], [True, False], [False, True], [False, False]]
    assert got.pairs == 8
    assert got.share == pytest.approx(4 / 8)
    assert got.per_layer == pytest.approx([2 / 4, 2 / 4])
    assert got.tokens_all_layers == pytest.approx(1 / 4)


def test_margin_view_flip_share_is_flips_over_pairs_of_each_bin():
    gaps_NL = torch.tensor([[0.5, 5e-5], [2e-3, 0.2], [0.3, 5e-5], [2e-3, 5e-3]], dtype=torch.float64)
    agreement = routing_agreement(record(A), record(B))
    got = margin_view(agreement, gaps_NL)
    bins = len(MARGIN_EDGES) - 1
    for layer in range(2):
        pairs, flips = [0] * bins, [0] * bins
        for n in range(4):
            g = float(gaps_NL[n, layer])
            i = max(j for j in range(bins) if MARGIN_EDGES[j] <= g)
            pairs[i] += 1
            flips[i] += not bool(agreement.same_NL[n, layer])
        assert got["pairs"][layer] == pairs
        assert got["flip_share"][layer] == pytest.approx([f / max(p, 1) for f, p in zip(flips, pairs)])
    assert got["flip_share"][0][4] == pytest.approx(0.5)  # gaps 0.5 and 0.3: token 0 kept, token 2 flipped


def test_score_gaps_are_the_kth_minus_the_next_gate_logit():
    model = small_lm("topk", {"top_k": 2}, dtype=torch.float64).eval()
    idx_BT = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    routers = [m for m in model.modules() if isinstance(m, moe.Router)]
    assert len(routers) == 2
    seen = {}
    hooks = [
        r.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out.detach()))
        for i, r in enumerate(routers)
    ]
    with torch.no_grad():
        model(idx_BT)
    for h in hooks:
        h.remove()
    ordered = [seen[i].sort(-1, descending=True).values for i in range(2)]
    expected = torch.stack([o[:, 1] - o[:, 2] for o in ordered], 1)
    got = score_gaps(model, idx_BT)
    assert got.shape == (14, 2)
    assert torch.allclose(got, expected.double(), atol=1e-12)
    assert math.isfinite(float(got.min())) and float(got.min()) >= 0


def test_prefix_forwards_record_and_predict_each_last_token_as_the_full_forward_of_a_causal_router():
    """topk is causal: the forward of the prefix 0..t routes and predicts token t as the full
    forward does, so the prefix path's record and logits are the full forward's."""
    model = small_lm("topk", {"top_k": 2}, dtype=torch.float64).eval()
    idx_BT = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    run = run_prefixes(model, idx_BT)
    with torch.no_grad():
        out = model(idx_BT)
    assert run.record.experts.shape[:3] == (2, 6, 2)
    for layer, routing in enumerate(out.routings):
        pairs = assignments(routing)
        for b in range(2):
            for t in range(6):
                want = {e for n, e in pairs if n == b * 6 + t}
                got = set(run.record.experts[b, t, layer].tolist()) - {-1}
                assert got == want, (layer, b, t)
    assert torch.allclose(run.logits, out.logits.float(), atol=1e-5)
