"""The routers of 2025-2026 against hand-worked cases and slow per-pair references: quantile
balancing (Megatron-Core) and sequence-level top-k (SeqTopK). Identity gates make the inputs
the logits; float64 throughout, so equalities are exact up to the last bit of a softmax."""

import math

import pytest
import torch
from helpers import assignments as pairs
from helpers import hand_logits as rows
from helpers import identity_router

import moe

# -- quantile balancing ----------------------------------------------------------------------


def test_quantile_routes_by_logits_minus_bias_with_softmax_weights_over_the_chosen():
    r = identity_router("quantile", 3, top_k=2)
    x = rows([2.0, 1.0, 0.0], [0.0, 0.5, 3.0])
    out = r(x)
    assert pairs(out) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    dense = out.dense()[0]
    assert dense[0, 0].item() == pytest.approx(math.e / (math.e + 1), rel=1e-12)  # softmax over logits 2, 1
    assert dense[1, 2].item() == pytest.approx(1 / (1 + math.exp(-2.5)), rel=1e-12)  # softmax over 3, 0.5
    with torch.no_grad():
        r.beta.copy_(torch.tensor([0.0, 0.0, 3.2]))  # expert 2 made expensive: token 1 takes 0 and 1
    assert pairs(r(x)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_quantile_bias_is_the_column_quantile_that_balances_the_step_hand_case():
    # N=4 tokens, E=2, K=1: target load C = 4*1//2 = 2. Every token prefers expert 0.
    r = identity_router("quantile", 2, top_k=1)
    x = rows([3.0, 0.0], [2.0, 0.0], [1.0, 0.5], [4.0, 3.5])
    assert pairs(r(x)) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # beta = 0: all four on expert 0
    # alpha_n = the 2nd best logit (the (K+1)-th): 0, 0, 0.5, 3.5. scores - alpha:
    #   expert 0: 3, 2, 0.5, 0.5;  expert 1: 0, 0, 0, 0.  The (C+1) = 3rd largest: 0.5 and 0.
    # beta = those minus their mean: [0.25, -0.25].
    r.update_after_step()
    assert r.beta.tolist() == pytest.approx([0.25, -0.25], abs=1e-6)
    # logits - beta: token 2 (1 - 0.25 = 0.75 vs 0.75) ties, token 3 (3.75 vs 3.75) ties; topk keeps
    # the lower index on ties; nudge to see the balance: the two closest tokens move to expert 1.
    with torch.no_grad():
        r.beta.add_(torch.tensor([1e-3, 0.0]))
    assert pairs(r(x)) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_quantile_update_averages_training_forwards_ignores_eval_and_blends_with_ema():
    def recorded(xs, ema=0.0):
        r = identity_router("quantile", 2, top_k=1, ema=ema)
        with torch.no_grad():
            r.beta.copy_(torch.tensor([0.5, -0.5]))
        for x in xs:
            r(x)
        r.eval()
        r(rows([9.0, -9.0], [9.0, -9.0]))  # an evaluation forward records nothing
        r.train()
        r.update_after_step()
        return r.beta.clone()

    a = rows([3.0, 0.0], [2.0, 0.0], [1.0, 0.5], [4.0, 3.5])
    b = rows([0.0, 1.0], [0.0, 2.0], [1.0, 1.5], [0.0, 0.5])
    beta_a, beta_b = recorded([a]), recorded([b])
    both = recorded([a, b])
    assert torch.allclose(both, (beta_a + beta_b) / 2, atol=1e-6)  # the mean of the forwards, not their sum
    blended = recorded([a], ema=0.75)
    expect = 0.75 * torch.tensor([0.5, -0.5]) + 0.25 * beta_a  # beta_a is already centred; so is the old bias
    assert torch.allclose(blended, expect - expect.mean(), atol=1e-6)
    r = identity_router("quantile", 2, top_k=1)
    r.update_after_step()  # no forward: beta stays
    assert r.beta.tolist() == [0.0, 0.0]


def test_quantile_updates_drive_a_skewed_population_to_balance():
    """One update is one step of the dual coordinate descent: it removes most of the skew, and
    repeated updates on the same batch settle near the target load N*K/E."""
    torch.manual_seed(0)
    e, k, n = 8, 2, 512
    r = identity_router("quantile", e, top_k=k)
    x = torch.randn(1, n, e, dtype=torch.float64) + torch.linspace(0, 3, e, dtype=torch.float64)
    target = n * k / e
    devs = []
    for _ in range(6):
        devs.append(float((r(x).stats["tokens_per_expert"] - target).abs().max()))
        r.update_after_step()
    assert devs[0] > 1.5 * target  # the skew: the last expert is wanted by most tokens
    assert devs[1] < devs[0] / 4, devs
    assert devs[-1] < 0.1 * target, devs


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(top_k=4), r"top_k must be an integer in \[1, num_experts - 1 = 3\]"),
        (dict(top_k=0), "top_k must be an integer"),
        (dict(ema=1.0), r"ema must be in \[0, 1\)"),
    ],
)
def test_quantile_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        moe.build_router("quantile", d_model=4, num_experts=4, **options)


# -- SeqTopK ---------------------------------------------------------------------------------


def reference_seq_topk(logits_TE: torch.Tensor, k: int, online: bool) -> set[tuple[int, int]]:
    """Per (token, expert) pair, in Python: the T*K best softmax scores of the sequence, or
    (online) for each position p the pairs of row p among the (p+1)*K best of rows 0..p."""
    probs = torch.softmax(logits_TE, -1).tolist()
    t = len(probs)
    scored = [(probs[i][j], i, j) for i in range(t) for j in range(len(probs[i]))]
    if not online:
        return {(i, j) for _, i, j in sorted(scored, reverse=True)[: t * k]}
    kept = set()
    for p in range(t):
        best = sorted((s for s in scored if s[1] <= p), reverse=True)[: (p + 1) * k]
        kept |= {(i, j) for _, i, j in best if i == p}
    return kept


def test_seq_topk_hand_case_spends_the_budget_where_the_scores_are():
    # softmax rows: token 0 [0.987, 0.0066, 0.0066], token 1 [0.506, 0.307, 0.186],
    # token 2 [1/3, 1/3, 1/3]. The best 3 of 9: (0,0), (1,0), (2,*)=1/3 x3 ties with... no:
    # 0.987 > 0.506 > 1/3 = 1/3 = 1/3 > 0.307: the third slot goes to token 2's first expert.
    r = identity_router("seq_topk", 3, top_k=1)
    out = r(rows([5.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 0.0, 0.0]))
    assert pairs(out) == [(0, 0), (1, 0), (2, 0)]
    r2 = identity_router("seq_topk", 3, top_k=2)  # 6 of 9: token 0 stays at one expert, token 2 takes all three
    out2 = r2(rows([5.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 0.0, 0.0]))
    assert pairs(out2) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    w = out2.dense()[0]
    assert w[0, 0].item() == 1.0  # renormalised over the token's one expert
    assert w[1, 0].item() == pytest.approx(math.e / (math.e + math.exp(0.5)), rel=1e-12)
    assert w[2].tolist() == pytest.approx([1 / 3] * 3, rel=1e-12)


def test_seq_topk_later_tokens_change_earlier_routing():
    r = identity_router("seq_topk", 3, top_k=1)
    # softmax rows: [0.787, 0.107, 0.107], [0.401, 0.300, 0.300], [0.356, 0.322, 0.322]
    x = rows([2.0, 0.0, 0.0], [0.3, 0.0, 0.0], [0.1, 0.0, 0.0])
    future = x.clone()
    future[0, 2] = torch.tensor([5.0, 5.0, -9.0])  # a last token torn between two experts: 0.5, 0.5
    assert pairs(r(x)) == [(0, 0), (1, 0), (2, 0)]
    assert pairs(r(future)) == [(0, 0), (2, 0), (2, 1)]  # token 1 lost its expert to the future


@pytest.mark.parametrize("k", [1, 2, 3])
def test_seq_topk_full_forward_and_online_decoding_against_per_pair_references(k):
    torch.manual_seed(k)
    e, t = 5, 9
    x = torch.randn(2, t, e, dtype=torch.float64) * 2
    r = identity_router("seq_topk", e, top_k=k).eval()
    full = r(x)
    state = r.init_decode_state(2)
    chunks = [r(x[:, s:stop], decode_state=state) for s, stop in ((0, 1), (1, 4), (4, 5), (5, t))]
    for b in range(2):
        assert {tuple(p) for p in full.mask()[b].nonzero().tolist()} == reference_seq_topk(x[b], k, online=False)
        decoded = torch.cat([c.mask()[b] for c in chunks])
        assert {tuple(p) for p in decoded.nonzero().tolist()} == reference_seq_topk(x[b], k, online=True)
    assert int(full.stats["tokens_per_expert"].sum()) == 2 * t * k  # the full budget, exactly
    assert state.position == t


def test_seq_topk_claims_and_decoding():
    r = moe.build_router("seq_topk", d_model=4, num_experts=4)
    assert r.claims == moe.Claims(False, False, True, decode_consistent=False)
    assert r.decode_support() is None  # the online variant decodes from the expert cache
    assert moe.build_router("quantile", d_model=4, num_experts=4).claims == moe.Claims(True, True, True, True)
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, num_experts=4\]"):
        moe.build_router("seq_topk", d_model=4, num_experts=4, top_k=5)
