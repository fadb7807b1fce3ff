"""Token rounding (SonicMoE): hand-worked cases and a per-expert Python reference of the rule in
float64 (pairs exact, weights to 1e-12: a softmax over 4 entries rounds at ~1e-16, a wrong rule
moves a whole pair); eval mode is top-k exactly; the audit finds the training leak and batch
coupling it claims and nothing in eval mode; decoding, replay and the train/serve agreement."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_cache_decoding_is_the_full_forward,
    assert_replay_is_the_recorded_forward,
    identity_router,
    routed_weights,
    small_lm,
)
from helpers import assignments as pairs
from helpers import hand_logits as rows

import moe
from moe.agreement import train_serve_agreement
from moe.audit import audit


def reference(logits_NE: torch.Tensor, k: int, tile: int, rounding: str) -> dict[tuple[int, int], float]:
    """{(token, expert): weight} of sonic-moe's rule, one expert and one token at a time."""
    probs = torch.softmax(logits_NE, -1).tolist()
    n, e = len(probs), len(probs[0])
    picks = [sorted(range(e), key=lambda j: (-probs[i][j], j))[:k] for i in range(n)]
    weight = [{j: probs[i][j] / sum(probs[i][c] for c in picks[i]) for j in picks[i]} for i in range(n)]
    kept = {}
    for j in range(e):
        count = sum(j in p for p in picks)
        target = {"nearest": round(count / tile), "up": math.ceil(count / tile), "down": count // tile}[rounding]
        chosen = [i for i in range(n) if j in picks[i]]
        others = [i for i in range(n) if j not in picks[i]]
        ranked = sorted(chosen, key=lambda i: (-weight[i][j], i)) + sorted(others, key=lambda i: (-probs[i][j], i))
        for i in ranked[: min(target * tile, n)]:
            kept[(i, j)] = weight[i][j] if j in picks[i] else probs[i][j]
    return kept


def test_hand_case_rounds_each_experts_count_up_down_and_to_the_nearest_tile():
    # softmax rows [.88, .12], [.73, .27], [.62, .38], [.27, .73]; top-1: expert 0 gets tokens 0, 1, 2
    # (count 3), expert 1 token 3 (count 1); tiles of 2.
    x = rows([2.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.0, 1.0])
    got = {
        r: identity_router("token_rounding", 2, top_k=1, tile_size=2, rounding=r).train()(x)
        for r in ("nearest", "up", "down")
    }
    # nearest: 3 -> 4 adds token 3 (its expert-0 score .27); 1 -> round(0.5) = 0 (half to even) drops token 3's only expert
    assert pairs(got["nearest"]) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert got["nearest"].dense()[0, 3, 0].item() == pytest.approx(1 / (1 + math.e), rel=1e-12)
    # up: 3 -> 4 as above, 1 -> 2 adds token 2 (its expert-1 score .38, the best of the others)
    assert pairs(got["up"]) == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert got["up"].dense()[0, 2].tolist() == pytest.approx([1.0, 1 / (1 + math.exp(0.5))], rel=1e-12)
    assert got["up"].stats["rounded_in"].item() == pytest.approx(2 / 4)
    # down: 3 -> 2 drops the lowest-weight choice (token 2), 1 -> 0 drops token 3: two tokens get no expert
    assert pairs(got["down"]) == [(0, 0), (1, 0)]
    assert got["down"].stats["dropped_fraction"].item() == pytest.approx(0.5)
    assert got["down"].stats["rounded_out"].item() == pytest.approx(2 / 4)
    eval_pairs = pairs(identity_router("token_rounding", 2, top_k=1, tile_size=2).eval()(x))
    assert eval_pairs == [(0, 0), (1, 0), (2, 0), (3, 1)]  # serving: plain top-1


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
@pytest.mark.parametrize("seed", [0, 1])
def test_training_routing_equals_the_reference_rule(rounding, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 9, 6, generator=gen, dtype=torch.float64)
    x[1, 4] = x[0, 2]  # a tie between two tokens: the earlier keeps its rank
    r = identity_router("token_rounding", 6, top_k=2, tile_size=4, rounding=rounding).train()
    got, want = routed_weights(r(x)), reference(x.reshape(-1, 6), 2, 4, rounding)
    assert set(got) == set(want)
    assert max(abs(got[p] - want[p]) for p in want) < 1e-12


def test_eval_is_topk_and_a_tile_of_one_trains_as_topk():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    rounding = moe.build_router("token_rounding", d_model=16, num_experts=4, top_k=2, tile_size=8)
    topk = moe.build_router("topk", d_model=16, num_experts=4, top_k=2)
    topk.load_state_dict(rounding.state_dict())
    assert torch.equal(rounding.eval()(x).dense(), topk(x).dense())
    assert not torch.equal(rounding.train()(x).dense(), topk(x).dense())
    one = moe.build_router("token_rounding", d_model=16, num_experts=4, top_k=2, tile_size=1).train()
    one.load_state_dict(rounding.state_dict())
    assert torch.equal(one(x).dense(), topk(x).dense())


def test_audit_finds_the_training_leak_and_batch_coupling_it_claims_and_eval_clean():
    torch.manual_seed(0)
    router = moe.build_router("token_rounding", d_model=16, num_experts=4, top_k=2, tile_size=4)
    report = audit(router, torch.randn(3, 10, 16), trials=1)
    assert report.claims_hold, report.table()
    assert report.leaks_in == ["train"] and not report.batch_invariant, report.table()
    assert report.decode_differs_in == ["train"], report.table()  # prefixes route differently in training only
    model = small_lm("token_rounding", {"top_k": 2, "tile_size": 4})
    report = audit(model, torch.randint(0, 32, (3, 10)), trials=1, agreement=False)
    assert report.claims_hold and report.leaks_in == ["train"] and not report.batch_invariant, report.table()


def test_eval_decodes_through_the_cache_like_the_full_forward_and_training_refuses():
    model = small_lm("token_rounding", {"top_k": 2, "tile_size": 4}).eval()
    idx = torch.randint(0, 32, (2, 10))
    assert_cache_decoding_is_the_full_forward(model, idx)
    with pytest.raises(ValueError, match="not causal in training mode"):
        model.train().init_cache(2)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_replay_is_the_recorded_forward_bit_for_bit(mode):
    model = small_lm("token_rounding", {"top_k": 2, "tile_size": 4}, torch.float64).train(mode == "train")
    idx, targets = torch.randint(0, 32, (3, 9)), torch.randint(0, 32, (3, 9))
    record = assert_replay_is_the_recorded_forward(model, idx, targets)
    if mode == "train":  # the rounded routing, with tokens of 0 to E experts, is what was replayed
        assert (record.experts < 0).any()


def test_train_serve_agreement_measures_the_routing_rounding_changes():
    idx = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    rounded = small_lm("token_rounding", {"top_k": 2, "tile_size": 8}).eval()
    figure = train_serve_agreement(rounded, idx)
    assert figure.pairs == 4 * 12 * 2 and 0.3 < figure.share < 1.0, figure.line()
    assert not rounded.training  # the mode is restored
    with torch.no_grad(), moe.record_routing(rounded) as served:
        rounded(idx)
    with torch.no_grad(), moe.record_routing(rounded.train()) as trained:
        rounded(idx)
    assert moe.agreement.routing_agreement(trained, served).share == figure.share  # the two forwards, by hand
    assert train_serve_agreement(small_lm("token_rounding", {"top_k": 2, "tile_size": 1}), idx).share == 1.0
    assert train_serve_agreement(small_lm("topk", {"top_k": 2}), idx).share == 1.0


@pytest.mark.parametrize(
    "options,match",
    [
        ({"rounding": "floor"}, "rounding must be one of 'nearest', 'up', 'down'"),
        ({"tile_size": 0}, "tile_size must be"),
        ({"gate": "sigmoid"}, "routes as SonicMoE does .*: remove gate"),
        ({"balance_rate": 0.1, "route_scale": 2.0}, "remove route_scale, balance_rate"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        moe.build_router("token_rounding", d_model=8, num_experts=4, **options)
