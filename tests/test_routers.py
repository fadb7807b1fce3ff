"""Routers against hand-worked tiny cases; identity gates make the inputs the logits."""

import math

import pytest
import torch
from helpers import ROUTER_CONFIGS, assignments, identity_router
from helpers import hand_logits as logits

import moe


def test_registry_lists_builtins():
    assert moe.list_routers() == [
        "capacity",
        "doc_pool",
        "ec_predictor",
        "ec_threshold",
        "expert_choice",
        "hash",
        "quantile",
        "quantile_global",
        "remoe",
        "seq_topk",
        "sinkhorn",
        "token_rounding",
        "top_p",
        "topk",
    ]


def test_topk_hand_case_with_idle_expert():
    r = identity_router("topk", 4, top_k=2)
    x = logits([2, 1, 0, -9], [0, 3, 1, -9], [5, 0, 4, -9])
    out = r(x)
    assert assignments(out) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 0), (2, 2)]
    assert out.stats["tokens_per_expert"].tolist() == [2, 2, 2, 0]
    assert out.stats["dropped_fraction"].item() == 0.0
    # normalised top-2 softmax: token 0 keeps e^2 : e^1
    dense = out.dense()[0]
    assert dense[0, 0].item() == pytest.approx(math.e / (math.e + 1), rel=1e-12)
    assert dense[0, 1].item() == pytest.approx(1 / (math.e + 1), rel=1e-12)
    assert torch.allclose(dense.sum(-1), torch.ones(3, dtype=torch.float64))


def test_topk_unnormalised_sigmoid_weights():
    r = identity_router("topk", 3, top_k=1, gate="sigmoid", normalize=False)
    out = r(logits([0.5, 2.0, -1.0]))
    assert assignments(out) == [(0, 1)]
    assert out.weight.item() == pytest.approx(1 / (1 + math.exp(-2.0)), rel=1e-12)


def test_capacity_drop_decisions_position_vs_score():
    # E=2, k=1, T=4, capacity_factor 0.5 -> C = ceil(0.5*4*1/2) = 1 slot per expert.
    x = logits([1, 0], [3, 0], [2, 0], [0, 1])
    pos = identity_router("capacity", 2, top_k=1, capacity_factor=0.5, priority="position")(x)
    score = identity_router("capacity", 2, top_k=1, capacity_factor=0.5, priority="score")(x)
    assert assignments(pos) == [(0, 0), (3, 1)]  # first come, first served
    assert assignments(score) == [(1, 0), (3, 1)]  # the highest score evicts token 0
    for out in (pos, score):
        assert out.stats["dropped_fraction"].item() == 0.5
        assert out.stats["capacity"].item() == 1
        assert out.experts_per_token().tolist() in ([1, 0, 0, 1], [0, 1, 0, 1])


def test_capacity_top2_interleaves_choices_in_position_order():
    # T=2, k=2, E=2, C = ceil(0.5*2*2/2) = 1. Token 0 prefers e0 then e1; token 1 e1 then e0.
    x = logits([2, 1], [1, 2])
    pos = identity_router("capacity", 2, top_k=2, capacity_factor=0.5, priority="position")(x)
    gshard = identity_router("capacity", 2, top_k=2, capacity_factor=0.5, priority="choice")(x)
    # causal order: token 0's second choice ranks before token 1's first -> token 1 gets nothing
    assert assignments(pos) == [(0, 0), (0, 1)]
    assert pos.experts_per_token().tolist() == [2, 0]
    # GShard order: all first choices queue first -> token 1's first choice evicts token 0's second
    assert assignments(gshard) == [(0, 0), (1, 1)]


def test_capacity_batch_group_is_time_major():
    # B=2, T=2, k=1. Sample 0 / position 0 wants e1, every other token wants e0.
    x = logits([0, 1], [1, 0], [1, 0], [1, 0], batch=2)
    batch = identity_router("capacity", 2, top_k=1, capacity_factor=0.5, group="batch")(x)
    seq = identity_router("capacity", 2, top_k=1, capacity_factor=0.5, group="sequence")(x)
    # batch group, C = ceil(0.5*4/2) = 1: e0's queue is (b1,t0), (b0,t1), (b1,t1) -> token 2 wins
    assert assignments(batch) == [(0, 1), (2, 0)]
    # per sequence, C = ceil(0.5*2/2) = 1: each sample fills its own slots
    assert assignments(seq) == [(0, 1), (1, 0), (2, 0)]


def test_capacity_prefix_scope_grows_slots_with_position():
    # E=2, k=1, every token wants e0, capacity_factor 1: C_t = ceil((t+1)/2) -> 1, 1, 2, 2, 3, 3
    x = logits(*([[1, 0]] * 6))
    out = identity_router("capacity", 2, top_k=1, capacity_factor=1.0, capacity_scope="prefix")(x)
    # token t is kept iff fewer than C_t tokens were kept before it: t = 0, 2, 4
    assert assignments(out) == [(0, 0), (2, 0), (4, 0)]
    x = logits([1, 0], [0, 1], [1, 0], [1, 0], [0, 1], [1, 0])
    out = identity_router("capacity", 2, top_k=1, capacity_factor=1.0, capacity_scope="prefix")(x)
    # e0: t0 (0 kept < C_0=1), t2 (1 < C_2=2), t3 (2 kept, not < C_3=2: dropped), t5 (2 < C_5=3)
    assert assignments(out) == [(0, 0), (1, 1), (2, 0), (4, 1), (5, 0)]
    # the "group" scope uses C = ceil(6/2) = 3 for everyone: t3 is kept, t5 dropped
    group = identity_router("capacity", 2, top_k=1, capacity_factor=1.0)(x)
    assert assignments(group) == [(0, 0), (1, 1), (2, 0), (3, 0), (4, 1)]


def test_kept_under_ceiling_matches_a_sequential_walk():
    from moe.routers.capacity import kept_under_ceiling

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = int(torch.randint(1, 80, (1,), generator=gen))
        segment = torch.randint(0, 5, (a,), generator=gen)
        priority = torch.randperm(a, generator=gen).double()
        ceiling = (priority // 3).long() + 1  # non-decreasing along each segment's walk
        keep = kept_under_ceiling(segment, priority, ceiling)
        kept = {}
        for i in sorted(range(a), key=lambda i: priority[i]):
            s = int(segment[i])
            want = kept.get(s, 0) < ceiling[i]
            assert bool(keep[i]) == bool(want)
            kept[s] = kept.get(s, 0) + int(want)


@pytest.mark.parametrize("group", ["sequence", "batch"])
def test_capacity_prefix_scope_is_decode_consistent(group):
    torch.manual_seed(3)
    r = moe.build_router(
        "capacity", d_model=8, num_experts=4, top_k=2, capacity_factor=0.5, group=group, capacity_scope="prefix"
    )
    x = torch.randn(3, 12, 8)
    full = r(x).dense()
    for t in range(12):
        assert torch.equal(r(x[:, : t + 1]).dense()[:, t], full[:, t]), t
    grouped = moe.build_router("capacity", d_model=8, num_experts=4, top_k=2, capacity_factor=0.5, group=group)
    grouped.load_state_dict(r.state_dict())
    full = grouped(x).dense()
    assert any(not torch.equal(grouped(x[:, : t + 1]).dense()[:, t], full[:, t]) for t in range(12))


def test_capacity_unbounded_equals_topk():
    torch.manual_seed(1)
    for opts in ({"top_k": 2}, {"top_k": 3, "gate": "sigmoid", "normalize": False}):
        topk = moe.build_router("topk", d_model=16, num_experts=6, **opts)
        for priority in ("position", "score", "choice"):
            for group in ("sequence", "batch"):
                cap = moe.build_router(
                    "capacity",
                    d_model=16,
                    num_experts=6,
                    capacity_factor=float("inf"),
                    priority=priority,
                    group=group,
                    **opts,
                )
                cap.load_state_dict(topk.state_dict())
                x = torch.randn(3, 10, 16)
                a, b = topk(x), cap(x)
                assert torch.equal(a.dense(), b.dense()), (priority, group)
                assert b.stats["dropped_fraction"].item() == 0.0


def test_expert_choice_hand_case_and_unserved_tokens():
    x = logits([2, 0], [0, 2], [1, 0], [3, 0])
    ec = identity_router("expert_choice", 2, capacity_factor=1.0)(x)  # C = 2
    assert assignments(ec) == [(0, 0), (1, 1), (2, 1), (3, 0)]
    assert ec.weight.shape == (4,)
    half = identity_router("expert_choice", 2, capacity_factor=0.5)(x)  # C = 1
    assert assignments(half) == [(1, 1), (3, 0)]
    assert half.stats["dropped_fraction"].item() == 0.5
    assert half.stats["tokens_per_expert"].tolist() == [1, 1]


def test_expert_choice_can_give_a_token_every_expert():
    x = logits([5, 5, 5], [0, 0, 0], [0, 0, 0])
    out = identity_router("expert_choice", 3, capacity_factor=1.0)(x)  # C = 1
    assert out.experts_per_token().tolist() == [3, 0, 0]


def test_ec_threshold_routes_by_threshold_and_learns_from_past_batches():
    r = identity_router("ec_threshold", 2, capacity_factor=0.5, momentum=0.5)
    x = logits([2, 0], [0, 2], [1, 0], [3, 0])
    probs = torch.softmax(x[0], -1)
    # before any update the threshold is 1/E = 0.5: every token goes to its argmax expert
    assert assignments(r(x)) == [(0, 0), (1, 1), (2, 0), (3, 0)]
    assert r.pending_count.item() == 1  # training forward recorded the batch, threshold unchanged
    assert torch.equal(r.threshold, torch.full((2,), 0.5, dtype=torch.float64))
    r.update_after_step()
    # bias-corrected EMA: after one update the threshold is this batch's C-th (C=1) best score
    expected = probs.max(0).values
    assert torch.allclose(r.threshold, expected, rtol=0, atol=1e-15)
    out = r(x)
    assert assignments(out) == [(1, 1), (3, 0)]
    r.update_after_step()
    assert torch.allclose(r.threshold, expected, rtol=0, atol=1e-15)  # same statistics, same EMA


def test_ec_predictor_routes_by_predictor_in_eval_only():
    r = identity_router("ec_predictor", 2, capacity_factor=0.5)
    with torch.no_grad():
        r.predictor.weight.copy_(torch.eye(2))
    x = logits([2, -1], [-1, -2], [1, 3], [3, -3])
    train = r(x)
    assert assignments(train) == [(2, 1), (3, 0)]  # expert choice, C = 1
    assert train.aux_loss.item() > 0  # includes the predictor's BCE
    r.eval()
    ev = r(x)
    assert assignments(ev) == [(0, 0), (2, 0), (2, 1), (3, 0)]  # predictor logit > 0
    assert ev.weight.tolist() == pytest.approx(torch.softmax(x[0], -1)[ev.token, ev.expert].tolist())


def test_switch_load_balance_loss_value():
    r = identity_router("topk", 2, top_k=1, aux_loss_coef=1.0, z_loss_coef=0.0)
    x = logits([2, 0], [1, 0], [0, 1])
    p = torch.softmax(x[0], -1)
    f = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    assert r(x).aux_loss.item() == pytest.approx(2 * (f * p.mean(0)).sum().item(), rel=1e-12)
    rz = identity_router("topk", 2, top_k=1, aux_loss_coef=0.0, z_loss_coef=1.0)
    assert rz(x).aux_loss.item() == pytest.approx(torch.logsumexp(x[0], -1).square().mean().item(), rel=1e-12)


def test_aux_loss_free_bias_moves_towards_balance_from_past_loads():
    r = identity_router("topk", 3, top_k=1, balance_rate=0.1, aux_loss_coef=0.0)
    x = logits([3, 0, 0], [2, 0, 0], [0, 1, 0], [4, 0, 0])
    before = assignments(r(x))
    assert torch.equal(r.balance_bias, torch.zeros(3))  # forward alone changes no routing state
    r.update_after_step()
    assert r.balance_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1])
    assert torch.equal(r.load_seen, torch.zeros(3))
    r.eval()
    r(x)
    r.update_after_step()  # eval forwards are not counted
    assert r.balance_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1])
    assert before == [(0, 0), (1, 0), (2, 1), (3, 0)]


@pytest.mark.parametrize("name,opts", ROUTER_CONFIGS)
def test_routing_contract(name, opts):
    r = moe.build_router(name, d_model=8, num_experts=4, **opts)
    x = torch.randn(2, 6, 8)
    out = r(x)
    assert out.token.dtype == torch.int64 and out.expert.dtype == torch.int64
    assert out.num_tokens == 12 and out.num_experts == 4 and out.batch_shape == (2, 6)
    assert out.dense().shape == (2, 6, 4) and out.mask().shape == (2, 6, 4)
    assert int(out.stats["tokens_per_expert"].sum()) == out.num_assignments
    assert 0.0 <= float(out.stats["dropped_fraction"]) <= 1.0
    assert out.aux_loss.dim() == 0
    assert len(set(zip(out.token.tolist(), out.expert.tolist()))) == out.num_assignments  # no duplicates
    assert isinstance(r.claims, moe.Claims)


def future_changes_past(name, opts, seed, t=3):
    torch.manual_seed(seed)
    r = moe.build_router(name, d_model=8, num_experts=4, **opts)
    x = torch.randn(2, 8, 8)
    x2 = x.clone()
    x2[:, t + 1 :] = 3 * torch.randn_like(x2[:, t + 1 :])
    return not torch.equal(r(x).dense()[:, : t + 1], r(x2).dense()[:, : t + 1])


@pytest.mark.parametrize(
    "name,opts",
    [("topk", {"top_k": 2}), ("capacity", {"top_k": 2, "capacity_factor": 0.5}), ("ec_threshold", {})],
)
def test_causal_routers_ignore_future_tokens(name, opts):
    assert not any(future_changes_past(name, opts, seed) for seed in range(10))


def test_expert_choice_lets_future_tokens_change_the_past():
    assert any(future_changes_past("expert_choice", {"capacity_factor": 0.5}, seed) for seed in range(10))


def test_claims():
    c = lambda name, **o: moe.build_router(name, d_model=4, num_experts=2, **o).claims  # noqa: E731
    assert c("topk") == moe.Claims(True, True, True, decode_consistent=True)
    assert c("capacity", group="batch") == moe.Claims(True, True, False)
    assert c("capacity", capacity_scope="prefix") == moe.Claims(True, True, True, decode_consistent=True)
    assert c("capacity", priority="score") == moe.Claims(False, False, True)
    assert c("expert_choice", group="batch") == moe.Claims(False, False, False)
    assert c("ec_threshold") == moe.Claims(True, True, True, decode_consistent=True)
    assert c("ec_predictor") == moe.Claims(False, True, True, decode_consistent=True)
    assert c("ec_threshold", statistic="population", score="sigmoid") == moe.Claims(True, True, True, True)
    assert c("remoe") == moe.Claims(True, True, True, decode_consistent=True)
    assert c("top_p", target_experts=1.5) == moe.Claims(True, True, True, decode_consistent=True)
    assert c("topk", null_experts=2) == moe.Claims(True, True, True, decode_consistent=True)
    r = moe.build_router("ec_predictor", d_model=4, num_experts=2)
    assert r.causal is False and r.eval().causal is True


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="nope"), "unknown router 'nope'; known routers: capacity, .*, topk"),
        (dict(name="topk", top_k=0), "top_k must be an integer in \\[1, num_experts=4\\]"),
        (dict(name="topk", top_k=5), "top_k must be an integer in \\[1, num_experts=4\\]"),
        (dict(name="capacity", capacity_factor=0), "capacity_factor must be > 0"),
        (dict(name="expert_choice", capacity_factor=-1.0), "capacity_factor must be > 0"),
        (dict(name="capacity", priority="random"), "priority must be"),
        (dict(name="capacity", capacity_scope="prefix", priority="score"), "capacity_scope='prefix' needs priority"),
        (dict(name="capacity", capacity_scope="global"), "capacity_scope must be"),
        (dict(name="topk", gate="relu"), "gate must be"),
        (dict(name="topk", d_model=0), "d_model must be a positive integer"),
        (dict(name="topk", num_experts=-2), "num_experts must be a positive integer"),
        (dict(name="topk", bogus=1), "bad options for router 'topk'"),
    ],
)
def test_bad_router_options(kwargs, match):
    kwargs = {"d_model": 8, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        moe.build_router(kwargs.pop("name"), **kwargs)


def test_bad_router_inputs():
    r = moe.build_router("topk", d_model=8, num_experts=4, check_finite=True)
    with pytest.raises(ValueError, match=r"expected input of shape \[B, T, D=8\]"):
        r(torch.randn(4, 8))
    with pytest.raises(ValueError, match="expected last dimension D=8"):
        r(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match="expected floating-point features"):
        r(torch.ones(2, 3, 8, dtype=torch.int64))
    x = torch.randn(2, 3, 8)
    x[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="router logits contain NaN or inf"):
        r(x)


def test_nan_check_is_a_debug_option(monkeypatch):
    # Off by default (it synchronises with the device on every call); MOE_DEBUG=1 turns it on.
    x = torch.randn(2, 3, 8)
    x[1, 2, 0] = float("nan")
    monkeypatch.delenv("MOE_DEBUG", raising=False)
    moe.build_router("topk", d_model=8, num_experts=4)(x)
    monkeypatch.setenv("MOE_DEBUG", "1")
    with pytest.raises(ValueError, match=r"router logits contain NaN or inf \(input has 1 non-finite values\)"):
        moe.build_router("topk", d_model=8, num_experts=4)(x)
    moe.build_router("topk", d_model=8, num_experts=4, check_finite=False)(x)


class _PositiveLogits(moe.Router):
    """A router of the test's own that says it is token-local and implements ``route_local``
    only: token n goes to every expert whose logit is positive, weighted by its sigmoid. It
    remembers the ``record`` flag of each call."""

    token_local = True

    def __init__(self, d_model, num_experts):
        super().__init__(d_model, num_experts, aux_loss_coef=0.0, z_loss_coef=0.0)
        self.records = []

    def route_local(self, logits_NE, batch_shape, record, expert_NK=None):
        self.records.append(record)
        n, e = logits_NE.shape
        keep_NE = logits_NE.detach() > 0 if expert_NK is None else moe.routing.slots_mask(expert_NK, e)
        token_A, expert_A = keep_NE.nonzero(as_tuple=True)
        return moe.Routing(
            token=token_A,
            expert=expert_A,
            weight=torch.sigmoid(logits_NE)[token_A, expert_A],
            num_tokens=n,
            num_experts=e,
            aux_loss=logits_NE.new_zeros(()),
            stats=moe.routing.served_stats(token_A, expert_A, n, e),
            batch_shape=batch_shape,
        )


def _positive_logits_reference(logits_BTE):
    """The dense weights of ``_PositiveLogits``, element by element."""
    out = torch.zeros_like(logits_BTE)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in logits_BTE.shape)).tolist():
        v = logits_BTE[tuple(idx)].item()
        out[tuple(idx)] = 1.0 / (1.0 + math.exp(-v)) if v > 0 else 0.0
    return out


def test_token_local_router_implements_one_hook():
    """``token_local = True`` and ``route_local`` alone give a router its claims, forward,
    decoding and replay; ``record`` is True exactly in a training forward that is not decoding."""
    torch.manual_seed(0)
    r = _PositiveLogits(4, 4).double()
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4, dtype=torch.float64))
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    assert r.claims == moe.Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)
    full = r(x)  # training mode
    torch.testing.assert_close(full.dense(), _positive_logits_reference(x), rtol=0, atol=1e-15)
    state = r.init_decode_state(2)
    chunks = [r(x[:, :2], decode_state=state), r(x[:, 2:], decode_state=state)]
    torch.testing.assert_close(torch.cat([c.dense() for c in chunks], 1), full.dense(), rtol=0, atol=0)
    given_NK = torch.tensor([[0, -1]] * 10)
    logits_NE = r.score_logits(x.reshape(10, 4))
    replayed = r.replay(logits_NE, x, (2, 5), given_NK, decoding=False)
    assert assignments(replayed) == [(n, 0) for n in range(10)]
    r.replay(logits_NE, x, (2, 5), given_NK, decoding=True)
    r.eval()
    r(x)
    assert r.records == [True, False, False, True, False, False]


def test_every_router_has_one_line_of_inheritance():
    """A registered router subclasses Router through single inheritance only (a family's base at
    most between them)."""
    for name, cls in moe.routing.registered_routers().items():
        chain = cls.__mro__[: cls.__mro__.index(moe.Router)]
        assert all(len(c.__bases__) == 1 for c in chain), f"{name}: {[c.__name__ for c in cls.__mro__]}"


@pytest.mark.parametrize(
    "factor,group,top_k,experts",
    [("1.25", 10, 2, 4), ("1", 10, 1, 4), ("0.3", 7, 2, 3), ("2.5", 9, 1, 8), ("0.01", 16, 1, 4), ("8", 5, 2, 2)],
)
def test_capacity_per_group_is_the_ceiling_of_the_exact_product(factor, group, top_k, experts):
    """C = ceil(cf * S * K / E) clamped to [1, S], the same from an int group size and from a
    tensor of sizes, against the ceiling of the exact rational product (the cases include
    products that are not whole: 6.25 -> 7, 1.4 -> 2, 2.8125 -> 3)."""
    from fractions import Fraction

    want = max(1, min(group, math.ceil(Fraction(factor) * group * top_k / experts)))
    assert moe.routing.capacity_per_group(float(factor), group, top_k, experts) == want
    sizes = torch.tensor([group, group + 1])
    from_tensor = moe.routing.capacity_per_group(float(factor), sizes, top_k, experts)
    other = max(1, min(group + 1, math.ceil(Fraction(factor) * (group + 1) * top_k / experts)))
    assert from_tensor.tolist() == [want, other]


def test_expert_choice_keeps_the_ceiling_of_a_fractional_capacity():
    """cf 1.25, T 10, E 4: C = ceil(3.125) = 4 tokens per expert and sequence, each expert's four
    highest-scoring tokens of its sequence (a float64 sort as the reference)."""
    torch.manual_seed(0)
    r = moe.build_router("expert_choice", d_model=8, num_experts=4, capacity_factor=1.25)
    x = torch.randn(2, 10, 8)
    out = r(x)
    probs = torch.softmax(r.gate(x.reshape(20, 8)).double(), dim=-1).view(2, 10, 4)
    chosen = out.mask()
    for b in range(2):
        for e in range(4):
            top = set(torch.sort(probs[b, :, e], descending=True).indices[:4].tolist())
            assert set(chosen[b, :, e].nonzero().flatten().tolist()) == top, (b, e)


def test_dense_sums_the_weights_of_a_repeated_pair():
    """A hand-built routing may name a (token, expert) pair twice; the data path adds both rows,
    and so does :meth:`Routing.dense` (a fixed-size form's dropped duplicate, weight 0, adds
    nothing and does not overwrite the kept one)."""
    w = torch.tensor([0.25, 0.5, 0.125])
    r = moe.Routing(
        token=torch.tensor([0, 0, 1]),
        expert=torch.tensor([1, 1, 0]),
        weight=w,
        num_tokens=2,
        num_experts=2,
        aux_loss=torch.zeros(()),
    )
    assert r.dense()[0].tolist() == [[0.0, 0.75], [0.125, 0.0]]
    fixed = moe.Routing(
        token=torch.tensor([0, 0]),
        expert=torch.tensor([1, 1]),
        weight=torch.tensor([0.5, 0.0]),
        num_tokens=1,
        num_experts=2,
        aux_loss=torch.zeros(()),
        valid=torch.tensor([True, False]),
    )
    assert fixed.dense()[0, 0].tolist() == [0.0, 0.5]
