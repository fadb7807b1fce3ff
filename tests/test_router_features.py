"""The router features production MoE models train with (issue 47), against slow per-token
references written from the peers' definitions in float64: score functions (softmax before or
after the top-k, sigmoid, sqrt-softplus), route normalisation and scaling, group-limited
routing, the balance bias, the balance losses at three granularities, and shared experts.

Identity gates (``helpers.identity_router``) make the input features the router logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEEPSEEK_V3_STYLE, identity_router

import moe
from moe.audit import audit
from moe.global_balance import global_batch_loads
from moe.layer import active_ffn_width
from moe.model import MoETransformer, preset
from moe.parallel.state import share_router_statistics
from moe.routing import RouterContext

E = 8


def score(x: float, fn: str) -> float:
    """One expert's score from its logit (sigmoid / sqrt-softplus; softmax is per row)."""
    if fn == "sigmoid":
        return 1.0 / (1.0 + math.exp(-x))
    return math.sqrt(math.log1p(math.exp(x)))


def reference_topk(row: list[float], opts: dict, bias: list[float]) -> dict[int, float]:
    """expert -> weight of one token, by Megatron-Core's topk_routing_with_score_function and
    transformers' DeepseekV3TopkRouter written out for one row."""
    k, fn = opts["top_k"], opts.get("gate", "softmax")
    pre = opts.get("pre_softmax", True)
    if fn == "softmax":
        z = sum(math.exp(v) for v in row)
        scores = [math.exp(v) / z for v in row]
    else:
        scores = [score(v, fn) for v in row]
    choice = [(s if pre else v) + b for s, v, b in zip(scores, row, bias)]
    allowed = set(range(len(row)))
    g, m = opts.get("num_expert_groups"), opts.get("num_limited_groups")
    if g:
        size = len(row) // g
        group_score = [sum(sorted(choice[i * size : (i + 1) * size])[-2:]) for i in range(g)]
        kept = sorted(range(g), key=lambda i: -group_score[i])[:m]
        allowed = {e for i in kept for e in range(i * size, (i + 1) * size)}
    chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
    if pre:
        w = {e: scores[e] for e in chosen}
    else:
        z = sum(math.exp(row[e]) for e in chosen)
        w = {e: math.exp(row[e]) / z for e in chosen}
    if opts.get("normalize", True):
        total = sum(w.values()) + 1e-20
        w = {e: v / total for e, v in w.items()}
    return {e: v * opts.get("route_scale", 1.0) for e, v in w.items()}


TOPK_OPTIONS = [
    {"top_k": 2},
    {"top_k": 2, "pre_softmax": False, "normalize": False},
    {"top_k": 3, "gate": "sigmoid", "normalize": False},
    {"top_k": 2, "gate": "sqrtsoftplus", "route_scale": 2.5},
    {"top_k": 4, "gate": "sigmoid", "num_expert_groups": 4, "num_limited_groups": 2, "route_scale": 2.5},
    {"top_k": 2, "gate": "sqrtsoftplus", "num_expert_groups": 2, "num_limited_groups": 1, "normalize": False},
    {"top_k": 3, "pre_softmax": False, "num_expert_groups": 4, "num_limited_groups": 2},
]


@pytest.mark.parametrize("opts", TOPK_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("router", ["topk", "capacity"])
def test_selection_matches_the_peers_definition_token_by_token(router, opts, biased):
    torch.manual_seed(1)
    extra = {"capacity_factor": float("inf")} if router == "capacity" else {}
    r = identity_router(router, E, **opts, **extra)
    bias = torch.randn(E, dtype=torch.float64) * 0.3 if biased else torch.zeros(E, dtype=torch.float64)
    r.balance_bias.copy_(bias)
    x = torch.randn(2, 9, E, dtype=torch.float64) * 2
    got = r(x).dense().view(-1, E)
    for n, row in enumerate(x.view(-1, E).tolist()):
        want = reference_topk(row, opts, bias.tolist())
        assert set(got[n].nonzero().view(-1).tolist()) == set(want), (n, got[n], want)
        for e, w in want.items():
            assert got[n, e].item() == pytest.approx(w, rel=1e-12, abs=1e-15), (n, e)


def test_group_limited_routing_hand_case():
    # 4 groups of 2 experts; the token's best expert (7, score 2.0) sits in a group whose second
    # expert is weak: group sums are 1.5+1.4, 1.0+0.9, 0.1+0.0, 2.0-3.0 -> groups 0 and 1 win.
    x = torch.tensor([[[1.5, 1.4, 1.0, 0.9, 0.1, 0.0, -3.0, 2.0]]], dtype=torch.float64)
    grouped = identity_router(
        "topk", E, top_k=3, pre_softmax=False, num_expert_groups=4, num_limited_groups=2, normalize=False
    )
    assert sorted(grouped(x).expert.tolist()) == [0, 1, 2]
    assert sorted(identity_router("topk", E, top_k=3)(x).expert.tolist()) == [0, 1, 7]


def test_balance_bias_selects_but_does_not_weigh():
    # the bias moves expert 2 into the top-2; its weight is its unbiased sigmoid score
    r = identity_router("topk", 4, top_k=2, gate="sigmoid", normalize=False)
    r.balance_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    out = r(torch.tensor([[[2.0, 1.0, 0.0, -1.0]]], dtype=torch.float64))
    assert sorted(zip(out.expert.tolist(), out.weight.tolist())) == [
        (0, pytest.approx(score(2.0, "sigmoid"))),
        (2, 0.5),
    ]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"gate": "relu"}, "gate must be one of"),
        ({"gate": "sigmoid", "pre_softmax": False}, "pre_softmax=False applies to gate='softmax'"),
        ({"route_scale": 0.0}, "route_scale must be > 0"),
        ({"num_expert_groups": 4}, "set together"),
        ({"num_expert_groups": 3, "num_limited_groups": 1}, "must divide num_experts=8"),
        ({"num_expert_groups": 8, "num_limited_groups": 1}, "groups of at least 2 experts"),
        ({"num_expert_groups": 4, "num_limited_groups": 5}, "exceeds num_expert_groups"),
        ({"top_k": 5, "num_expert_groups": 4, "num_limited_groups": 2}, "top_k=5 exceeds the 4 experts"),
        ({"null_experts": 2, "num_expert_groups": 4, "num_limited_groups": 2}, "do not combine"),
        ({"seq_aux_loss_coef": -1.0}, "loss coefficients must be >= 0"),
    ],
)
def test_bad_feature_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        moe.build_router("topk", d_model=8, num_experts=E, **kwargs)


def test_threshold_and_dynamic_routers_take_the_options_that_apply():
    x = torch.randn(2, 6, E, dtype=torch.float64)
    ec = identity_router("ec_threshold", E, score="sqrtsoftplus", route_scale=2.0)
    ec.ema_sum.fill_(1.0)
    ec.ema_weight.fill_(1.0)  # threshold 1.0 on sqrt(softplus(x)): kept iff softplus(x) >= 1
    out = ec(x)
    want = {
        (n, e): 2.0 * score(v, "sqrtsoftplus")
        for n, row in enumerate(x.view(-1, E).tolist())
        for e, v in enumerate(row)
    }
    want = {k: w for k, w in want.items() if w >= 2.0}
    got = dict(zip(zip(out.token.tolist(), out.expert.tolist()), out.weight.tolist()))
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in want)
    plain, scaled = identity_router("top_p", E, p=0.5), identity_router("top_p", E, p=0.5, route_scale=3.0)
    assert torch.allclose(scaled(x).weight, 3.0 * plain(x).weight, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="unbounded"):
        moe.build_router("ec_threshold", d_model=8, num_experts=E, score="sqrtsoftplus", statistic="population")
    with pytest.raises(ValueError, match="route_scale"):
        moe.build_router("top_p", d_model=8, num_experts=E, route_scale=-1.0)


# -- balance losses ------------------------------------------------------------------------------
def reference_balance(x_BTE: torch.Tensor, opts: dict, granularity: str) -> float:
    """coef * E * sum_e f_e * P_e per Megatron-Core's switch_load_balancing_loss_func, f counted
    from each token's top-k of the unbiased, ungrouped scores and P the scores normalised over
    the E experts (compute_routing_scores_for_aux_loss), over the batch or each sequence."""
    k, fn = opts["top_k"], opts.get("gate", "softmax")
    rows = x_BTE.tolist()

    def probs(row):
        s = [math.exp(v) for v in row] if fn == "softmax" else [score(v, fn) for v in row]
        return [v / sum(s) for v in s]

    def switch(tokens):
        count, p_sum = [0] * E, [0.0] * E
        for row in tokens:
            p = probs(row)
            for e in sorted(range(E), key=lambda e: -p[e])[:k]:
                count[e] += 1
            p_sum = [a + b for a, b in zip(p_sum, p)]
        return E * sum(c / (k * len(tokens)) * s / len(tokens) for c, s in zip(count, p_sum))

    if granularity == "sequence":
        return sum(switch(seq) for seq in rows) / len(rows)
    return switch([row for seq in rows for row in seq])


GRANULARITIES = {"micro": "aux_loss_coef", "sequence": "seq_aux_loss_coef", "global": "global_aux_loss_coef"}
BALANCE_OPTIONS = [
    {"top_k": 2},
    {"top_k": 2, "gate": "sigmoid", "num_expert_groups": 4, "num_limited_groups": 1, "balance_rate": 0.1},
    {"top_k": 3, "gate": "sqrtsoftplus"},
]


@pytest.mark.parametrize("opts", BALANCE_OPTIONS, ids=["softmax", "sigmoid-groups-bias", "sqrtsoftplus"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_balance_loss_values(granularity, opts):
    x = torch.randn(3, 7, E, dtype=torch.float64) * 2
    coefs = {c: 0.0 for c in GRANULARITIES.values()}
    r = identity_router("topk", E, **opts, **{**coefs, GRANULARITIES[granularity]: 0.5}, z_loss_coef=0.0)
    r.balance_bias.copy_(torch.linspace(-1, 1, E, dtype=torch.float64))  # changes routing, not the losses
    got = r(x).aux_loss.item()
    ref = {**opts, "gate": opts.get("gate", "softmax")}
    assert got == pytest.approx(0.5 * reference_balance(x, ref, "sequence" if granularity == "sequence" else "batch"))


def test_sequence_loss_differs_from_the_batch_loss():
    # two sequences each loading one expert: balanced over the batch, unbalanced per sequence
    x = torch.full((2, 4, 2), -5.0, dtype=torch.float64)
    x[0, :, 0] = 5.0
    x[1, :, 1] = 5.0
    loss = {
        g: identity_router("topk", 2, top_k=1, z_loss_coef=0.0, aux_loss_coef=0.0, **{c: 1.0})(x).aux_loss.item()
        for g, c in GRANULARITIES.items()
        if g != "micro"
    }
    assert loss["global"] == pytest.approx(1.0, abs=1e-3) and loss["sequence"] == pytest.approx(2.0, abs=1e-3)


def tiny_global_model(**router_options) -> MoETransformer:
    torch.manual_seed(0)
    options = {"top_k": 2, "aux_loss_coef": 0.0, "z_loss_coef": 0.0, **router_options}
    cfg = preset("tiny", d_model=32, n_heads=4, moe_d_ff=32, num_experts=4, router="topk", router_options=options)
    return MoETransformer(cfg).double()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replay_statistics_and_global_balance_reach_a_router_through_its_context_only():
    """Recording, replay, shared statistics and the global batch's loads set fields of each
    router's RouterContext (and put them back), never an attribute of the router itself."""
    model = tiny_global_model(global_aux_loss_coef=1.0)
    routers = model.routers()
    attributes = [set(vars(r)) for r in routers]
    idx = torch.randint(0, 256, (4, 12))
    with moe.record_routing(model) as record:
        assert all(r.context.routing_hook is not None for r in routers)
        model(idx)
    with moe.replay_routing(model, record):
        model(idx)
    with global_batch_loads(model, [lambda c=c: model(c) for c in idx.chunk(2)]):
        assert all(r.context.global_load is not None for r in routers)
    group = object()  # a process group stand-in: nothing runs a collective here
    share_router_statistics(model, group)
    assert all(r.context.stats_group is group for r in routers)
    share_router_statistics(model, None)
    assert all(r.context == RouterContext() for r in routers)
    assert [set(vars(r)) for r in routers] == attributes


@pytest.mark.parametrize("coef", ["global_aux_loss_coef", "seq_aux_loss_coef"])
def test_microbatches_give_the_whole_batch_loss_and_gradients(coef):
    """Value and gradient of the global and sequence losses over M = 2 microbatches equal one
    forward of the whole batch; the plain micro-batch loss does not (the control)."""
    idx = torch.randint(0, 256, (4, 12))
    for key, equal in ((coef, True), ("aux_loss_coef", False)):
        model = tiny_global_model(**{key: 1.0}, balance_rate=0.1)
        whole = model(idx).aux_loss
        whole.backward()
        want = grads(model)
        model.zero_grad()
        load_before = model.routers()[0].load_seen.clone()
        chunks = idx.chunk(2)
        total = 0.0
        with global_batch_loads(model, [lambda c=c: model(c) for c in chunks]):
            assert torch.equal(model.routers()[0].load_seen, load_before)  # the counting forwards left no state
            for c in chunks:
                aux = model(c).aux_loss / 2
                aux.backward()
                total += aux.item()
        assert model.routers()[0].context.global_load is None  # cleared after the step
        got = grads(model)
        diff = max((got[n] - want[n]).abs().max().item() for n in want)
        if equal:
            assert total == pytest.approx(whole.item(), rel=1e-12) and diff < 1e-12, (total, whole.item(), diff)
        else:
            assert abs(total - whole.item()) > 1e-6 or diff > 1e-6


# -- shared experts -----------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_a_swiglu_of_width_s_times_f(gated):
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 6, 4, router="topk", top_k=2, shared_experts=2, shared_expert_gate=gated).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y, routing = layer(x, return_routing=True)
    routed = moe.MoELayer(8, 6, 4, router=layer.router, experts=layer.experts).double()(x)
    sh = layer.shared.ffn
    for n in range(10):
        xn = x.view(-1, 8)[n]
        # two experts of width 6 each (the halves of the S*F = 12 hidden units), summed
        want = sum(
            sh.w_down.weight[:, h] @ (F.silu(sh.w_gate.weight[h] @ xn) * (sh.w_up.weight[h] @ xn))
            for h in (slice(0, 6), slice(6, 12))
        )
        if gated:
            want = want / (1 + math.exp(-(layer.shared.gate.weight[0] @ xn).item()))
        got = y.view(-1, 8)[n] - routed.view(-1, 8)[n]
        assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()
    y.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.shared.parameters())


def test_shared_experts_are_active_parameters_and_count_in_the_compute_check():
    cfg = preset("tiny", d_model=32, n_heads=4, moe_d_ff=16, num_experts=4, router_options={"top_k": 2})
    plain = MoETransformer(cfg)
    shared = MoETransformer(preset("tiny", **{**cfg.__dict__, "shared_experts": 1, "shared_expert_gate": True}))
    per_layer = 3 * 32 * 16 + 32  # one SwiGLU of width 16 and the [1, D] gate
    assert shared.num_parameters() - plain.num_parameters() == 2 * per_layer
    assert shared.num_parameters(active=True) - plain.num_parameters(active=True) == 2 * per_layer
    router = moe.build_router("topk", d_model=32, num_experts=4, top_k=2)
    assert active_ffn_width(router, 16) == 32 and active_ffn_width(router, 16, shared_experts=1) == 48
    assert shared.blocks[0].ffn.active_ffn_width() == 48
    assert active_ffn_width(moe.build_router("top_p", d_model=32, num_experts=4), 16, 1) is None


def test_bad_shared_expert_options():
    with pytest.raises(ValueError, match="shared_experts must be an integer >= 0"):
        moe.MoELayer(8, 6, 4, shared_experts=-1)
    with pytest.raises(ValueError, match="shared_expert_gate needs shared_experts > 0"):
        moe.MoELayer(8, 6, 4, shared_expert_gate=True)
    with pytest.raises(ValueError, match="shared_expert_gate needs shared_experts > 0"):
        preset("tiny", shared_expert_gate=True)


# -- the audit, both ways ------------------------------------------------------------------------
AUDITED = [
    # every feature on a causal router: the claimed safety must survive the audit
    ("layer", "topk", {**DEEPSEEK_V3_STYLE, "aux_loss_coef": 0.01}, False),
    ("router", "ec_threshold", {"score": "sqrtsoftplus", "route_scale": 2.0}, False),
    ("model", "topk", {**DEEPSEEK_V3_STYLE, "pre_softmax": True, "gate": "sqrtsoftplus"}, False),
    # the same routing with score-priority capacity: the claimed leak must be shown
    ("layer", "capacity", {**DEEPSEEK_V3_STYLE, "priority": "score", "capacity_factor": 1.0}, True),
]


@pytest.mark.parametrize("kind,router,options,leaks", AUDITED, ids=lambda v: v if isinstance(v, str) else None)
def test_features_are_audited_both_ways(kind, router, options, leaks):
    """Shared experts (gated), groups, sigmoid / sqrt-softplus scores, the route scale, a balance
    bias that changes choices and the three balance losses: the audit checks every claim."""
    torch.manual_seed(0)
    shared = {"shared_experts": 1, "shared_expert_gate": True}
    if kind == "router":
        target = moe.build_router(router, d_model=32, num_experts=4, **options)
        x = torch.randn(4, 16, 32)
    elif kind == "layer":
        target = moe.MoELayer(32, 64, 4, router=router, **shared, **options)
        x = torch.randn(4, 16, 32)
    else:
        target = MoETransformer(preset("tiny", router=router, router_options=options, **shared))
        x = torch.randint(0, 256, (4, 16))
    for r in target.modules():
        if isinstance(r, moe.routers.TokenChoiceBase):
            r.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    report = audit(target, x)
    assert report.claims is not None and not report.violations and not report.unshown, report.table()
    assert report.leaks == leaks, report.table()


def test_shared_experts_decode_with_the_kv_cache_as_the_full_forward():
    torch.manual_seed(0)
    cfg = preset(
        "tiny",
        d_model=32,
        n_heads=4,
        moe_d_ff=32,
        max_seq_len=40,
        router="topk",
        router_options=DEEPSEEK_V3_STYLE,
        shared_experts=2,
        shared_expert_gate=True,
    )
    model = MoETransformer(cfg).eval()
    for r in model.routers():
        r.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    prompts = [torch.randint(0, 256, (n,)) for n in (3, 8)]
    rows, logits_BSV = model.generate(prompts, 12, temperature=1.0, seed=1, return_logits=True)
    for b, row in enumerate(rows):
        with torch.no_grad():
            full_TV = model(row[None, :-1]).logits[0]
        # fp32: attention over a different number of keys per call rounds differently, ~1e-7
        assert (logits_BSV[b, : row.numel() - 1] - full_TV).abs().max() <= 1e-5


def test_global_balance_loss_is_refused_over_pipelined_microbatches():
    from moe.training import TrainConfig

    options = {"global_aux_loss_coef": 0.1}
    with pytest.raises(ValueError, match="global_aux_loss_coef over several microbatches"):
        TrainConfig.flat(router_options=options, pipeline_parallel=2, microbatches=2)
    TrainConfig.flat(router_options=options, microbatches=2)  # the plain step counts the batch first


def test_remoe_and_seq_topk_aux_losses_written_out():
    """ReMoE's aux loss is its load-weighted L1 penalty plus the z-loss; SeqTopK's the Switch loss
    E * sum_e f_e P_e over its kept pairs (f: share of the kept pairs, P: mean softmax score) plus
    the z-loss; logits set by hand, float64, one sequence of 3 tokens over 3 experts."""
    logits = [[1.0, -0.5, 0.25], [-1.0, 2.0, 0.5], [0.3, 0.1, -2.0]]
    x = torch.tensor([logits], dtype=torch.float64)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 3

    remoe = identity_router("remoe", 3, z_loss_coef=0.1, l1_init=0.5)
    active = [(n, e) for n in range(3) for e in range(3) if logits[n][e] > 0]
    f = [sum(1 for _, e2 in active if e2 == e) / len(active) for e in range(3)]
    l1 = 0.5 * sum(sum(max(logits[n][e], 0.0) for n in range(3)) / 3 * 3 * f[e] for e in range(3))
    assert remoe(x).aux_loss.item() == pytest.approx(l1 + 0.1 * z, rel=1e-12)

    seq = identity_router("seq_topk", 3, top_k=1, aux_loss_coef=0.2, z_loss_coef=0.1)
    probs = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in logits]
    kept = sorted(((probs[n][e], n, e) for n in range(3) for e in range(3)), reverse=True)[:3]  # the best T*K = 3
    f = [sum(1 for *_, e2 in kept if e2 == e) / 3 for e in range(3)]
    mean_p = [sum(probs[n][e] for n in range(3)) / 3 for e in range(3)]
    switch = 0.2 * 3 * sum(fe * pe for fe, pe in zip(f, mean_p))
    assert seq(x).aux_loss.item() == pytest.approx(switch + 0.1 * z, rel=1e-12)
