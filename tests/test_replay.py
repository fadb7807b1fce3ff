"""Routing replay: moe.record_routing / moe.replay_routing, RoutingRecord and Router.replay.

Exactness is checked against the recorded forward itself (``torch.equal``: the same bits for
outputs, aux losses, routings and every gradient, float64); replay with changed gate weights
against a per-token reference of each router's weight formula written out in float64 (1e-12:
float64 rounding of a softmax over 4-6 entries is ~1e-16, a wrong formula is off by > 1e-3).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from helpers import DEEPSEEK_V3_STYLE, small_lm

import moe
from moe.model import MoETransformer
from moe.parallel import ExpertParallel, load_full_state_dict
from moe.parallel.launch import ok_values, run_local
from moe.record import routing_slots
from moe.routing import Routing

CASES = {
    "topk": ("topk", {"top_k": 2}),
    "topk_sigmoid": ("topk", {"top_k": 2, "gate": "sigmoid", "normalize": False}),
    "topk_null": ("topk", {"top_k": 2, "null_experts": 2}),
    "topk_lossfree": ("topk", {"top_k": 2, "balance_rate": 0.1, "aux_loss_coef": 0.0}),
    "capacity": ("capacity", {"top_k": 2, "capacity_factor": 0.5}),
    "capacity_score_batch": ("capacity", {"top_k": 2, "capacity_factor": 0.5, "priority": "score", "group": "batch"}),
    "capacity_prefix": ("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"}),
    "expert_choice": ("expert_choice", {"capacity_factor": 1.0}),
    "expert_choice_batch": ("expert_choice", {"capacity_factor": 1.0, "group": "batch"}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 1.0}),
    "expert_threshold": ("ec_threshold", {"statistic": "population", "score": "sigmoid", "aux_loss_coef": 0.0}),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 1.0}),
    "remoe": ("remoe", {"top_k": 2}),
    "top_p": ("top_p", {"target_experts": 2.0}),
    "topk_post_softmax": ("topk", {"top_k": 2, "pre_softmax": False, "route_scale": 2.0}),
    "topk_sqrtsoftplus": ("topk", {"top_k": 2, "gate": "sqrtsoftplus", "normalize": False}),
    "topk_deepseek_v3": ("topk", DEEPSEEK_V3_STYLE),
    "capacity_post_softmax": (
        "capacity",
        {"top_k": 2, "capacity_factor": 0.5, "pre_softmax": False, "route_scale": 2.0},
    ),
    "quantile": ("quantile", {"top_k": 2}),
    "seq_topk": ("seq_topk", {"top_k": 2}),
}
MODEL_OPTIONS = {"topk_deepseek_v3": {"shared_experts": 1, "shared_expert_gate": True}}
"""Model options beside the router's: DeepSeek-V3's shared experts, which every token uses unrouted."""
V, E = 32, 4


def tiny(router: str, options: dict, dtype=torch.float64, max_seq_len: int = 32, **config) -> MoETransformer:
    return small_lm(router, options, dtype, V, max_seq_len, **config)


def forward_and_grads(model, idx, targets):
    out = model(idx, targets)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss + out.aux_loss, params, allow_unused=True)
    return out, grads


def pairs(routing: Routing) -> set[tuple[int, int]]:
    kept = routing.compact()
    return set(zip(kept.token.tolist(), kept.expert.tolist()))


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", CASES)
def test_replay_with_unchanged_weights_is_the_recorded_forward_bit_for_bit(case, mode):
    router, options = CASES[case]
    model = tiny(router, options, **MODEL_OPTIONS.get(case, {})).train(mode == "train")
    idx, targets = torch.randint(0, V, (3, 10)), torch.randint(0, V, (3, 10))
    with moe.record_routing(model) as record:
        out, grads = forward_and_grads(model, idx, targets)
    with moe.replay_routing(model, record):
        again, regrads = forward_and_grads(model, idx, targets)
    assert torch.equal(out.logits, again.logits), (out.logits - again.logits).abs().max()
    assert torch.equal(out.aux_loss, again.aux_loss), (out.aux_loss, again.aux_loss)
    for a, b in zip(out.routings, again.routings):
        assert torch.equal(a.token, b.token) and torch.equal(a.expert, b.expert) and torch.equal(a.weight, b.weight)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, h in zip(names, grads, regrads):
        assert (g is None) == (h is None), name
        assert g is None or torch.equal(g, h), f"{name}: max {(g - h).abs().max():.2e} mean {(g - h).abs().mean():.2e}"


def reference_scores(logits: list[float], fn: str) -> list[float]:
    if fn == "sigmoid":
        return [1 / (1 + math.exp(-v)) for v in logits]
    if fn == "sqrtsoftplus":
        return [math.sqrt(math.log1p(math.exp(v))) for v in logits]
    exp = [math.exp(v) for v in logits]
    return [v / sum(exp) for v in exp]


def reference_weights(router: moe.Router, x_ND: torch.Tensor, recorded: list[list[int]]) -> dict:
    """(token, expert) -> combine weight, written out per token in float64 from each router's formula."""
    w = router.gate.weight.detach().double()
    out = {}
    for n, chosen in enumerate(recorded):
        logits = [float(x_ND[n].double() @ w[e]) for e in range(router.num_experts)]
        if getattr(router, "null_experts", 0):
            logits += [float(x_ND[n].double() @ router.null_gate.weight.detach().double()[m]) for m in range(2)]
        score = reference_scores(logits, getattr(router, "gate_fn", getattr(router, "score", "softmax")))
        after_topk = router.name == "quantile" or not getattr(router, "pre_softmax", True)  # softmax of chosen logits
        if router.name == "capacity" or getattr(router, "null_experts", 0):
            # normalised over the current top-k, which the balance bias helps select
            bias = router.balance_bias.double().tolist() + [0.0] * (len(logits) - router.num_experts)
            ranked = logits if after_topk else score
            over = sorted(range(len(logits)), key=lambda e: -(ranked[e] + bias[e]))[: router.top_k]
        else:
            over = chosen  # over the recorded experts (R3)
        if after_topk:
            weight = [math.exp(v) / sum(math.exp(logits[e]) for e in over) for v in logits]
        elif router.name in ("topk", "capacity", "top_p", "seq_topk") and router.normalize:
            weight = [v / sum(score[e] for e in over) for v in score]
        elif router.name == "remoe":
            weight = [max(v, 0.0) for v in logits]
        else:
            weight = score
        for e in chosen:
            out[n, e] = weight[e] * getattr(router, "route_scale", 1.0)
    return out


@pytest.mark.parametrize("case", CASES)
def test_replay_with_changed_gates_routes_the_recorded_experts_with_each_routers_formula(case):
    name, options = CASES[case]
    router = moe.build_router(name, d_model=8, num_experts=E, **options).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    with moe.record_routing(router) as record:
        recorded = router(x)
    with torch.no_grad():  # the policy moved on since the tokens were routed
        router.gate.weight.add_(0.5 * torch.randn_like(router.gate.weight))
        if getattr(router, "null_experts", 0):
            router.null_gate.weight.add_(0.5 * torch.randn_like(router.null_gate.weight))
        for name in ("balance_bias", "beta"):  # state that selects only: the weights must not read it
            if hasattr(router, name):
                getattr(router, name).add_(torch.randn_like(getattr(router, name)))
    with moe.replay_routing(router, record):
        replayed = router(x)
    assert pairs(replayed) == pairs(recorded)
    assert pairs(router(x)) != pairs(recorded), "the changed gates must route differently, or nothing is tested"
    by_token = [[] for _ in range(24)]
    for t, e in sorted(pairs(recorded)):
        by_token[t].append(e)
    want = reference_weights(router, x.reshape(24, 8), by_token)
    got = dict(zip(zip(replayed.token.tolist(), replayed.expert.tolist()), replayed.weight.tolist()))
    worst = max(abs(got[k] - want[k]) / max(abs(want[k]), 1.0) for k in want)  # beside other choices, w may be >> 1
    assert worst < 1e-12, f"{case}: max |replayed - formula| / max(|formula|, 1) {worst:.2e}"
    replayed.weight.sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0, "the gate gets no gradient through the replayed weights"


def perturbed_gates(model: MoETransformer, scale: float = 0.5) -> MoETransformer:
    other = copy.deepcopy(model)
    with torch.no_grad():
        for r in other.routers():
            r.gate.weight.add_(scale * torch.randn_like(r.gate.weight))
    return other


def test_a_replayed_training_forward_moves_quantile_balancing_as_its_own_forward_would():
    # beta is a statistic of the scores (each token's (k+1)-th adjusted logit), not of the routed experts
    router = moe.build_router("quantile", d_model=8, num_experts=E, top_k=2).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    record = moe.RoutingRecord.from_engine(torch.rand(2, 12, 1, E).argsort(-1)[..., :2])  # not its own experts
    own = copy.deepcopy(router)
    own(x)
    own.update_after_step()
    with moe.replay_routing(router, record):
        router(x)
    router.update_after_step()
    assert torch.equal(router.beta, own.beta) and own.beta.abs().sum() > 0, (router.beta, own.beta)
    with moe.replay_routing(router, record):
        router(x[:, :1], decode_state=router.init_decode_state(2))  # a decoded chunk records nothing
    router.update_after_step()
    assert torch.equal(router.beta, own.beta)


def test_a_replayed_seq_topk_forward_reads_no_later_token():
    # SeqTopK's own routing of token t reads the whole sequence; its replayed weights read token t alone
    router = moe.build_router("seq_topk", d_model=8, num_experts=E, top_k=2).double()
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    later = x.clone()
    later[:, 6:] = torch.randn(1, 6, 8, dtype=torch.float64)
    distinct = torch.rand(1, 12, 1, E).argsort(-1)[..., :3]
    record = moe.RoutingRecord.from_engine(distinct.masked_fill(torch.rand(1, 12, 1, 3) < 0.3, -1))
    with moe.replay_routing(router, record):
        a, b = router(x).dense()[:, :6], router(later).dense()[:, :6]
    assert torch.equal(a, b), (a - b).abs().max()
    assert not torch.equal(router(x).dense()[:, :6], router(later).dense()[:, :6]), "its own routing must read them"


@pytest.mark.parametrize(
    "router, options",
    [("topk", {"top_k": 2}), ("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"})],
)
def test_a_kv_cache_generation_replays_into_the_training_forward(router, options):
    trainer = tiny(router, options, torch.float32)
    engine = perturbed_gates(trainer).eval()  # the policy that sampled, one step behind the trainer
    prompt = torch.randint(0, V, (2, 5))
    with moe.record_routing(engine) as record:
        seq, logits = engine.generate(prompt, 10, temperature=0, return_logits=True)
    assert (record.batch_size, record.length) == (2, 14)  # every forwarded position: the prompt, then 9 steps
    # the training forward of the same tokens routes as the engine did ...
    with moe.replay_routing(trainer, record), moe.record_routing(trainer) as seen:
        trainer(seq[:, :-1], seq[:, 1:]).loss.backward()
    assert torch.equal(seen.experts, record.experts)
    with torch.no_grad(), moe.record_routing(trainer) as own:
        trainer(seq[:, :-1])
    assert not torch.equal(own.experts, record.experts), "the trainer's own routing must differ, or nothing is tested"
    # ... and replayed in the engine's own weights, the positions line up with its decoding
    with torch.no_grad(), moe.replay_routing(engine, record):
        replayed = engine(seq[:, :-1]).logits
    err = (replayed - logits).abs()
    assert err.max() < 1e-5, f"replayed forward vs generate's logits: max {err.max():.2e} mean {err.mean():.2e}"


def test_an_engine_array_replays_and_the_record_saves_in_its_layout(tmp_path):
    # what an engine returns per request: [tokens, layers, top_k] int32, -1 where a token got fewer experts
    seq0 = np.array([[[0, 2, -1], [1, -1, -1]], [[3, -1, -1], [0, 1, 2]], [[-1, -1, -1], [2, 3, -1]]], dtype=np.int32)
    seq1 = np.array([[[1, -1, -1], [3, 0, -1]], [[2, 0, 1], [-1, -1, -1]], [[0, -1, -1], [1, -1, -1]]], dtype=np.int32)
    record = moe.RoutingRecord.from_engine([seq0, seq1])
    assert (record.batch_size, record.length, record.num_layers, record.slots) == (2, 3, 2, 3)
    assert record.bytes_per_token == 4 * 2 * 3
    model = tiny("ec_threshold", {}).eval()
    with torch.no_grad(), moe.replay_routing(model, record):
        out = model(torch.randint(0, V, (2, 3)))
    for layer, routing in enumerate(out.routings):
        want = {
            (b * 3 + t, int(e)) for b, arr in enumerate((seq0, seq1)) for t in range(3) for e in arr[t, layer] if e >= 0
        }
        assert pairs(routing) == want, f"layer {layer}"
    record.save(tmp_path / "routing.npz")
    files = np.load(tmp_path / "routing.npz")
    assert sorted(files.files) == ["num_sequences", "seq0", "seq1"] and files["seq0"].dtype == np.int32
    assert np.array_equal(files["seq0"], seq0) and np.array_equal(files["seq1"], seq1)
    assert torch.equal(moe.RoutingRecord.load(tmp_path / "routing.npz").experts, record.experts)
    np.save(tmp_path / "one.npy", seq1)
    assert torch.equal(moe.RoutingRecord.load(tmp_path / "one.npy").experts, record.experts[1:])


def test_a_record_pads_tokens_with_fewer_experts():
    model = tiny("expert_choice", {"capacity_factor": 1.0}).eval()
    with torch.no_grad(), moe.record_routing(model) as record:
        out = model(torch.randint(0, V, (2, 8)))
    assert record.slots == max(int(r.experts_per_token().max()) for r in out.routings)
    for layer, routing in enumerate(out.routings):
        filled = (record.experts[:, :, layer] >= 0).sum(-1).reshape(-1)
        assert torch.equal(filled, routing.experts_per_token()), f"layer {layer}"
    assert (record.experts[..., 0] == -1).any(), "some token got no expert: its slots are all -1"


def test_routing_slots_by_hand():
    routing = Routing(
        token=torch.tensor([2, 0, 0, 3]),
        expert=torch.tensor([1, 3, 0, 2]),
        weight=torch.ones(4),
        num_tokens=4,
        num_experts=4,
        aux_loss=torch.zeros(()),
    )
    assert routing_slots(routing).tolist() == [[3, 0], [-1, -1], [1, -1], [2, -1]]


def test_replay_refuses_what_it_cannot_route():
    model = tiny("topk", {"top_k": 2}).eval()
    with torch.no_grad(), moe.record_routing(model) as record:
        model(torch.randint(0, V, (2, 6)))
    with pytest.raises(ValueError, match="holds 2 sequences of 6 positions"):
        with moe.replay_routing(model, record):
            model(torch.randint(0, V, (2, 7)))
    with pytest.raises(ValueError, match="holds 2 sequences"):
        with moe.replay_routing(model, record):
            model(torch.randint(0, V, (3, 6)))
    with pytest.raises(ValueError, match="2 MoE layers"):
        moe.replay_routing(tiny("topk", {}).blocks[0], record).__enter__()
    with pytest.raises(ValueError, match="names expert 9"):
        moe.replay_routing(model, moe.RoutingRecord.from_engine(np.full((6, 2, 2), 9))).__enter__()
    with pytest.raises(ValueError, match="integers"):
        moe.RoutingRecord.from_engine(np.zeros((6, 2, 2)))
    with pytest.raises(ValueError, match="different shapes"):
        moe.RoutingRecord.from_engine([np.zeros((6, 2, 2), int), np.zeros((5, 2, 2), int)])
    cache = model.init_cache(2)
    model(torch.randint(0, V, (2, 3)), cache=cache)  # a prompt prefilled before recording began
    with pytest.raises(ValueError, match="from position 0"):
        with moe.record_routing(model):
            model(torch.randint(0, V, (2, 1)), cache=cache)
    assert all(r.context.routing_hook is None for r in model.routers()), "a failed context must leave no hook behind"


def _expert_parallel_worker(rank: int, world: int, full_state: dict, idx, targets, records: list) -> dict:
    ep = ExpertParallel(torch.distributed.group.WORLD)
    model = tiny("topk", {"top_k": 2}, max_seq_len=16)
    sharded = MoETransformer(model.cfg, expert_parallel=ep, init_seed=1).double()
    load_full_state_dict(sharded, full_state, ep)
    rows = slice(rank * 2, rank * 2 + 2)
    with moe.replay_routing(sharded, moe.RoutingRecord(2, records[rank])):
        out = sharded(idx[rows], targets[rows])
    out.loss.backward()
    return {"logits": out.logits.detach(), "gate_grad": [r.gate.weight.grad for r in sharded.routers()]}


def test_replay_under_expert_parallelism_equals_one_process():
    model = tiny("topk", {"top_k": 2}, max_seq_len=16)
    idx, targets = torch.randint(0, V, (4, 8)), torch.randint(0, V, (4, 8))
    engine = perturbed_gates(model)  # the record comes from other gates: replay must override these
    with torch.no_grad(), moe.record_routing(engine) as record:
        engine(idx)
    with moe.replay_routing(model, record):
        out = model(idx, targets)
    out.loss.backward()
    with torch.no_grad():
        assert (model(idx).logits - out.logits).abs().max() > 1e-3, "replay must change the routing here"
    halves = [record.rows(0, 2).experts, record.rows(2, 4).experts]
    per_rank = ok_values(run_local(_expert_parallel_worker, 2, model.state_dict(), idx, targets, halves))
    logits = torch.cat([r["logits"] for r in per_rank])
    assert (logits - out.logits).abs().max() < 1e-10, (logits - out.logits).abs().max()
    for layer, r in enumerate(model.routers()):  # each rank's gate gradient of its half: their sum is the whole
        grad = per_rank[0]["gate_grad"][layer] / 2 + per_rank[1]["gate_grad"][layer] / 2
        assert (grad - r.gate.weight.grad).abs().max() < 1e-10, f"layer {layer}"


def test_replay_under_activation_checkpointing_with_the_backward_inside():
    from moe.parallel.recompute import apply_activation_checkpointing

    model = tiny("topk", {"top_k": 2})
    idx, targets = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    engine = perturbed_gates(model)
    with torch.no_grad(), moe.record_routing(engine) as record:
        engine(idx)
    with moe.replay_routing(model, record):
        _, want = forward_and_grads(model, idx, targets)
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed.blocks, "full")  # the backward reruns each block's forward
    with moe.replay_routing(checkpointed, record):
        _, got = forward_and_grads(checkpointed, idx, targets)
    for g, h in zip(want, got):
        assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), (g - h).abs().max()
