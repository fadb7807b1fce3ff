"""The Sinkhorn router (S-BASE; Megatron-Core's sinkhorn load balancing) against a per-element
Python reference in float64, a hand case where balancing moves a token, its refusals, and its
claims audited: leaks and batch interference in training, causal and decodable in eval."""

import math

import pytest
import torch
from helpers import assignments, identity_router
from helpers import hand_logits as logits

import moe
from moe.audit import CausalityError, assert_causal, audit


def reference_sinkhorn(rows: list[list[float]], iterations: int) -> list[list[float]]:
    """Sinkhorn's alternating normalisation written out element by element (Megatron-Core's
    ``moe_utils.sinkhorn`` with a fixed number of rounds, eps 1e-8)."""
    n, e = len(rows), len(rows[0])
    cost = [[math.exp(v) for v in row] for row in rows]
    d0, d1 = [1.0] * n, [1.0] * e
    for _ in range(iterations):
        d0 = [(1.0 / n) / (sum(cost[i][j] * d1[j] for j in range(e)) + 1e-8) for i in range(n)]
        d1 = [(1.0 / e) / (sum(cost[i][j] * d0[i] for i in range(n)) + 1e-8) for j in range(e)]
    return [[d1[j] * cost[i][j] * d0[i] for j in range(e)] for i in range(n)]


def reference_routing(rows: list[list[float]], top_k: int, iterations: int, training: bool) -> list[tuple]:
    """(token, expert, weight) per assignment, token-major, a token's experts by decreasing
    choice value: the top-k of the balanced matrix (training) or of the softmax (eval), weighted
    by the softmax score."""
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    choice = reference_sinkhorn(rows, iterations) if training else probs
    out = []
    for n, row in enumerate(choice):
        for e in sorted(range(len(row)), key=lambda j: -row[j])[:top_k]:
            out.append((n, e, probs[n][e]))
    return out


@pytest.mark.parametrize("training", [True, False])
def test_sinkhorn_router_matches_the_reference(training):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, dtype=torch.float64) * 2
    r = identity_router("sinkhorn", 4, top_k=2, iterations=7).train(training)
    out = r(x.requires_grad_())
    want = reference_routing(x.detach().reshape(-1, 4).tolist(), 2, 7, training)
    assert list(zip(out.token.tolist(), out.expert.tolist())) == [(n, e) for n, e, _ in want]
    got_w = out.weight.detach()
    want_w = torch.tensor([w for _, _, w in want], dtype=torch.float64)
    assert torch.allclose(got_w, want_w, rtol=1e-12, atol=0), (got_w - want_w).abs().max()
    # the gradient reaches the gate through the softmax at the chosen experts (the choice is not differentiated)
    (out.weight * torch.arange(out.weight.numel(), dtype=torch.float64)).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    probs = torch.softmax(ref_x.reshape(-1, 4), -1)
    ref = sum(probs[n, e] * i for i, (n, e, _) in enumerate(want))
    ref.backward()
    assert torch.allclose(x.grad, ref_x.grad, rtol=1e-10, atol=1e-14), (x.grad - ref_x.grad).abs().max()


def test_balancing_moves_a_token_off_the_crowded_expert():
    """Four tokens that all rank expert 0 first: top-1 gives expert 0 everything, the balanced
    assignment sends the token that prefers it least elsewhere (worked out with the reference)."""
    x = logits([3.0, 0.0, 0.0], [3.0, 0.0, 0.0], [3.0, 0.0, 0.0], [2.0, 1.9, 0.0])
    r = identity_router("sinkhorn", 3, top_k=1, iterations=20)
    assert assignments(r.train()(x)) == [(0, 0), (1, 0), (2, 0), (3, 1)]
    assert assignments(r.eval()(x)) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    balanced = reference_sinkhorn(x.reshape(-1, 3).tolist(), 20)
    assert max(range(3), key=lambda j: balanced[3][j]) == 1


def test_sinkhorn_balances_rows_and_columns():
    from moe.routers.sinkhorn import sinkhorn

    torch.manual_seed(1)
    p = sinkhorn(torch.randn(64, 8, dtype=torch.float64) * 3, iterations=200)
    torch.testing.assert_close(p.sum(1), torch.full((64,), 1 / 64, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(p.sum(0), torch.full((8,), 1 / 8, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "options",
    [
        {"aux_loss_coef": 0.01},
        {"balance_rate": 1e-3},
        {"pre_softmax": False},
        {"gate": "sqrtsoftplus"},
        {"iterations": 0},
    ],
)
def test_sinkhorn_refuses_what_it_does_not_do(options):
    with pytest.raises(ValueError):
        moe.build_router("sinkhorn", d_model=8, num_experts=4, **options)


def test_sinkhorn_claims_hold_under_the_audit():
    """Training reads the whole forward (later tokens, other sequences): the audit finds the leak
    and the batch interference the router claims; eval mode is top-k: causal, batch-invariant
    and decode-consistent."""
    torch.manual_seed(0)
    router = moe.build_router("sinkhorn", d_model=16, num_experts=4, top_k=1)
    example = torch.randn(4, 16, 16)
    report = audit(router, example, modes=("train", "eval"))
    assert not report.false_claims and report.leaks_in == ["train"] and not report.batch_invariant
    with pytest.raises(CausalityError, match="leaks in train"):
        assert_causal(router, example, modes=("train",))
    serving = router.eval()
    assert_causal(lambda x_BTD: serving(x_BTD).dense(), example, batch_invariant=True, decode_consistent=True)
