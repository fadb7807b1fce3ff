"""Incremental decoding: router decode states, the model's KV cache, ``generate``, the causal
loss through the cache, and no host synchronisation in the routers' default path.

The reference is always the full-sequence forward (or, for whole generations, recomputing
every prefix): what decoding must reproduce for a decode-consistent router.
"""

import pytest
import torch
from helpers import DEEPSEEK_V3_STYLE, ROUTER_CONFIGS, identity_router

import moe
from moe.eval import evaluate
from moe.generation import generate
from moe.model import MoETransformer, preset

# Decode-consistent configurations; capacity factor 0.5 so that capacity routers drop.
DECODE_CONFIGS: list[tuple[str, dict]] = [
    ("topk", {"top_k": 2}),
    ("topk", {"top_k": 1, "gate": "sigmoid", "balance_rate": 0.1}),
    ("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"}),
    ("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix", "group": "batch"}),
    ("ec_threshold", {}),
    ("ec_predictor", {}),
    ("ec_threshold", {"statistic": "population", "score": "sigmoid", "aux_loss_coef": 0.0}),
    ("remoe", {}),
    ("top_p", {"target_experts": 2}),
    ("topk", {"top_k": 2, "null_experts": 2}),
    ("topk", DEEPSEEK_V3_STYLE),
    ("topk", {"top_k": 2, "gate": "sqrtsoftplus", "pre_softmax": True, "route_scale": 2.0}),
    ("topk", {"top_k": 2, "pre_softmax": False, "normalize": False, "num_expert_groups": 2, "num_limited_groups": 1}),
    ("ec_threshold", {"score": "sqrtsoftplus", "route_scale": 2.0}),
]
NOT_DECODABLE: list[tuple[str, dict]] = [
    ("expert_choice", {"capacity_factor": 0.5}),
    ("capacity", {"top_k": 2, "capacity_factor": 0.5}),  # causal, but C is sized from the sequence length
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in DECODE_CONFIGS]


def tiny_model(router: str, options: dict, **overrides) -> MoETransformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_heads=4, moe_d_ff=32, num_experts=4, max_seq_len=40, router=router, router_options=options)
    model = MoETransformer(preset("tiny", **{**cfg, **overrides}))
    set_router_state(model)
    return model.eval()


def set_router_state(model: torch.nn.Module) -> None:
    """Give routers that learn from past batches a state that matters: thresholds near the
    softmax scores, a balancing bias that changes choices."""
    for r in model.modules():
        if isinstance(r, moe.routers.ExpertChoiceThresholdRouter):
            r.ema_sum.fill_(0.85 if r.score == "sqrtsoftplus" else 0.27)  # sqrt(softplus(0)) = 0.83
            r.ema_weight.fill_(1.0)
        elif isinstance(r, moe.routers.TokenChoiceBase) and r.balance_rate > 0:
            r.balance_bias.copy_(torch.tensor([0.2, -0.1, 0.0, 0.05]))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# -- routers ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,options", DECODE_CONFIGS, ids=IDS)
def test_router_decodes_chunks_exactly_like_the_full_sequence(name, options):
    r = identity_router(name, 4, **options).eval()
    set_router_state(r)
    x_BTD = torch.randn(3, 23, 4, dtype=torch.float64)
    full = r(x_BTD)
    state = r.init_decode_state(3)
    start = 0
    for size in (5, 1, 1, 7, 1, 8):  # a prompt, single tokens, then longer chunks
        chunk = r(x_BTD[:, start : start + size], decode_state=state)
        assert torch.equal(chunk.dense(), full.dense()[:, start : start + size]), (name, options, start)
        start += size
        assert state.position == start
    assert start == 23
    if name == "capacity":
        assert full.stats["dropped_fraction"] > 0.2  # capacity binds: the kept counts matter
        kept_GE = full.mask().sum(1) if options.get("group") != "batch" else full.mask().sum((0, 1))[None]
        assert torch.equal(state.kept_GE, kept_GE)


@pytest.mark.parametrize("name,options", NOT_DECODABLE, ids=["expert_choice", "capacity-group-scope"])
def test_router_that_cannot_decode_refuses(name, options):
    r = moe.build_router(name, d_model=8, num_experts=4, **options)
    with pytest.raises(ValueError, match="is not decode-consistent"):
        r.init_decode_state(2)
    state = moe.build_router("topk", d_model=8, num_experts=4).init_decode_state(2)
    with pytest.raises(ValueError, match="is not decode-consistent"):
        r(torch.randn(2, 1, 8), decode_state=state)


def test_ec_predictor_decodes_in_eval_mode_only():
    r = moe.build_router("ec_predictor", d_model=8, num_experts=4)
    with pytest.raises(ValueError, match="not causal in training mode"):
        r.train().init_decode_state(2)
    assert r.eval().init_decode_state(2).position == 0


def test_decode_state_checks_the_batch_size():
    r = moe.build_router("topk", d_model=8, num_experts=4)
    with pytest.raises(ValueError, match="decode state is for batch size 2"):
        r(torch.randn(3, 1, 8), decode_state=r.init_decode_state(2))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        r.init_decode_state(0)


def test_ec_threshold_decoding_in_training_mode_records_no_statistics():
    r = identity_router("ec_threshold", 4).train()
    r(torch.randn(2, 6, 4, dtype=torch.float64), decode_state=r.init_decode_state(2))
    assert r.pending_count.item() == 0
    r(torch.randn(2, 6, 4, dtype=torch.float64))
    assert r.pending_count.item() == 2


# -- the model's KV cache -----------------------------------------------------------------
@pytest.mark.parametrize("name,options", DECODE_CONFIGS, ids=IDS)
def test_cached_forward_in_chunks_equals_full_forward(name, options):
    model = tiny_model(name, options)
    idx_BT = torch.randint(0, 256, (3, 30))
    with torch.no_grad():
        full_BTV = model(idx_BT).logits
        cache = model.init_cache(3)
        parts, start = [], 0
        for size in (9, 1, 1, 6, 1, 12):
            parts.append(model(idx_BT[:, start : start + size], cache=cache).logits)
            start += size
    assert cache.length == 30
    # fp32: attention over a different number of keys per call rounds differently, ~1e-7
    assert max_diff(torch.cat(parts, 1), full_BTV) <= 1e-5


def test_cache_errors():
    model = tiny_model("topk", {})
    cache = model.init_cache(2, max_len=4)
    with pytest.raises(ValueError, match="cache is for batch size 2"):
        model(torch.zeros(3, 1, dtype=torch.long), cache=cache)
    model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache holds 3 of at most 4 positions; cannot add 2"):
        model(torch.zeros(2, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"max_len must be an integer in \[1, max_seq_len=40\]"):
        model.init_cache(2, max_len=41)
    with pytest.raises(ValueError, match="MoE block 0: router 'expert_choice'"):
        tiny_model("expert_choice", {}).init_cache(2)


# -- generate -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,options", DECODE_CONFIGS, ids=IDS)
def test_generate_with_cache_matches_full_forward_at_every_step(name, options):
    model = tiny_model(name, options)
    n_new = 14
    if model.routers()[0].claims.batch_invariant:
        # prompts of different lengths; each returned row checked alone against a full forward
        prompts = [torch.randint(0, 256, (n,)) for n in (3, 9, 6)]
        rows, logits_BSV = model.generate(prompts, n_new, temperature=1.0, top_k=50, seed=1, return_logits=True)
        assert [r.numel() for r in rows] == [3 + n_new, 9 + n_new, 6 + n_new]
        for b, (p, row) in enumerate(zip(prompts, rows)):
            assert torch.equal(row[: p.numel()], p)
            with torch.no_grad():
                full_TV = model(row[None, :-1]).logits[0]
            assert max_diff(logits_BSV[b, : row.numel() - 1], full_TV) <= 1e-5, (name, b)
        batch_BS = torch.stack([r[: 3 + n_new] for r in rows])
    else:
        # routing grouped over the batch: all rows at once, prompts of equal length
        prompt_BT = torch.randint(0, 256, (3, 5))
        batch_BS, logits_BSV = model.generate(prompt_BT, n_new, temperature=1.0, top_k=50, seed=1, return_logits=True)
        assert batch_BS.shape == (3, 5 + n_new) and torch.equal(batch_BS[:, :5], prompt_BT)
        with torch.no_grad():
            full_BSV = model(batch_BS[:, :-1]).logits
        assert max_diff(logits_BSV, full_BSV) <= 1e-5, name
    if name == "capacity":  # the generated text really is routed under binding capacity
        with torch.no_grad():
            assert model(batch_BS).routings[0].stats["dropped_fraction"] > 0.2


@pytest.mark.parametrize("name,options", DECODE_CONFIGS, ids=IDS)
def test_greedy_cached_generation_equals_recomputing_every_prefix(name, options):
    model = tiny_model(name, options)
    prompts = [torch.randint(0, 256, (n,)) for n in (4, 2, 7)]
    cached, logits_c = model.generate(prompts, 16, temperature=0, return_logits=True)
    recomputed, logits_r = model.generate(prompts, 16, temperature=0, recompute=True, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(cached, recomputed)), (cached, recomputed)
    assert max_diff(logits_c, logits_r) <= 1e-5
    # greedy: each new token is the argmax of the logits before it
    for b, row in enumerate(cached):
        n = prompts[b].numel()
        assert torch.equal(row[n:], logits_c[b, n - 1 : row.numel() - 1].argmax(-1))


@pytest.mark.parametrize("name,options", NOT_DECODABLE, ids=["expert_choice", "capacity-group-scope"])
def test_not_decode_consistent_router_is_refused_and_its_difference_is_real(name, options):
    model = tiny_model(name, options)
    prompt_BT = torch.randint(0, 256, (2, 4))
    model.train()
    with pytest.raises(ValueError, match="not decode-consistent.*recompute=True"):
        model.generate(prompt_BT, 8)
    assert model.training  # generate decodes in eval mode and restores the mode, also after refusing
    model.eval()
    seq_BS, logits_BSV = model.generate(prompt_BT, 20, temperature=0, recompute=True, return_logits=True)
    with torch.no_grad():
        full_BSV = model(seq_BS[:, :-1]).logits
    # What decoding computed from each prefix is not what the full-sequence forward (training's
    # view) gives for the same tokens: the leak, made visible.
    assert max_diff(logits_BSV, full_BSV) > 1e-2
    assert not torch.equal(logits_BSV.argmax(-1), full_BSV.argmax(-1))


def test_generate_sampling_is_seeded_and_checks_its_arguments():
    model = tiny_model("topk", {})
    prompt = torch.randint(0, 256, (2, 3))
    a = model.generate(prompt, 10, seed=3, top_k=5)
    assert torch.equal(a, model.generate(prompt, 10, seed=3, top_k=5))
    assert not torch.equal(a, model.generate(prompt, 10, seed=4, top_k=5))
    assert torch.equal(
        model.generate(prompt, 10, temperature=0), model.generate(prompt, 10, temperature=0, top_k=1, seed=9)
    )
    assert torch.equal(model.generate(prompt, 0), prompt)
    for kwargs, match in [
        (dict(idx=torch.zeros(3, dtype=torch.long), max_new_tokens=1), r"shape \[B, T\]"),
        (dict(idx=[torch.zeros(2, dtype=torch.long), torch.zeros(0, dtype=torch.long)], max_new_tokens=1), "non-empty"),
        (dict(idx=prompt, max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        (dict(idx=prompt, max_new_tokens=1, temperature=-1.0), "temperature must be >= 0"),
        (dict(idx=prompt, max_new_tokens=1, top_k=0), "top_k must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            model.generate(**kwargs)
    with pytest.raises(ValueError, match="context must be a positive integer, got None"):
        generate(model, prompt, 1, context=None)  # an HF config without max_position_embeddings


PAST_THE_CONTEXT = [(*DECODE_CONFIGS[i], False) for i in (0, 2, 4)] + [(*NOT_DECODABLE[0], True)]


@pytest.mark.parametrize(
    "name,options,recompute", PAST_THE_CONTEXT, ids=[IDS[i] for i in (0, 2, 4)] + ["expert_choice-recompute"]
)
def test_generation_past_the_context_crops_to_the_last_max_seq_len_tokens(name, options, recompute):
    """The reference is nanoGPT's sampler: every step forwards the last max_seq_len tokens."""
    model = tiny_model(name, options)
    context, n_new = model.cfg.max_seq_len, 60
    for prompt_len in (5, context + 7):  # a prompt within the context, and one longer than it
        prompt_BT = torch.randint(0, 256, (2, prompt_len))
        seq_BS, logits_BSV = model.generate(prompt_BT, n_new, temperature=0, recompute=recompute, return_logits=True)
        ref_BS, ref_logits = prompt_BT, []
        with torch.no_grad():
            for _ in range(n_new):
                last_BV = model(ref_BS[:, -context:]).logits[:, -1]
                ref_logits.append(last_BV)
                ref_BS = torch.cat([ref_BS, last_BV.argmax(-1, keepdim=True)], 1)
        assert seq_BS.shape == (2, prompt_len + n_new) and torch.equal(seq_BS, ref_BS), (name, prompt_len)
        assert logits_BSV.shape[1] == prompt_len + n_new - 1 - max(0, prompt_len - context)
        assert max_diff(logits_BSV[:, -n_new:], torch.stack(ref_logits, 1)) <= 1e-5, (name, prompt_len)


# -- the causal loss through the cache ------------------------------------------------------
@pytest.mark.parametrize("name,options", [DECODE_CONFIGS[i] for i in (0, 2, 4)], ids=[IDS[i] for i in (0, 2, 4)])
def test_causal_loss_by_cache_equals_prefix_recomputation(name, options):
    model = tiny_model(name, options)
    val = torch.randint(0, 256, (2000,))
    for stride in (1, 3):  # one token per cached forward, and chunks of 3 ending at the evaluated positions
        kw = dict(seq_len=24, num_windows=5, causal_stride=stride, batch_size=3)
        cached = evaluate(model, val, causal_method="cache", **kw)
        recomputed = evaluate(model, val, causal_method="recompute", **kw)
        assert cached["eval_positions"] == recomputed["eval_positions"] == 5 * 24 // stride
        for key in ("teacher_forced_loss", "causal_loss", "leakage_gap"):
            assert cached[key] == pytest.approx(recomputed[key], abs=1e-6), (key, stride)
        assert evaluate(model, val, **kw)["causal_loss"] == cached["causal_loss"]  # auto: the cache


def test_causal_loss_of_a_router_that_cannot_decode_recomputes_prefixes():
    model = tiny_model("expert_choice", {"capacity_factor": 0.5})
    val = torch.randint(0, 256, (2000,))
    kw = dict(seq_len=16, num_windows=3, causal_stride=4, batch_size=3)
    auto = evaluate(model, val, **kw)
    assert auto == evaluate(model, val, causal_method="recompute", **kw)
    assert abs(auto["leakage_gap"]) > 1e-3
    with pytest.raises(ValueError, match="causal_method='cache' impossible: MoE block 0"):
        evaluate(model, val, causal_method="cache", **kw)
    with pytest.raises(ValueError, match="causal_method must be"):
        evaluate(model, val, causal_method="fast", **kw)


# -- no host synchronisation in the routers' default path ----------------------------------
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("name,options", ROUTER_CONFIGS + DECODE_CONFIGS[1:4])
def test_router_training_step_reads_nothing_on_the_host(name, options, monkeypatch):
    # On an accelerator each of these waits for the device (torch.bincount too: it reads the
    # maximum to size its output). Counted on CPU by wrapping them: no CUDA needed.
    monkeypatch.delenv("MOE_DEBUG", raising=False)
    router = moe.build_router(name, d_model=16, num_experts=4, **options)
    x_BTD = torch.randn(2, 12, 16, requires_grad=True)
    calls = []

    def counting(method, original):
        def wrapper(*args, **kwargs):
            calls.append(method)
            return original(*args, **kwargs)

        return wrapper

    for method in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, method, counting(method, getattr(torch.Tensor, method)))
    monkeypatch.setattr(torch, "bincount", counting("bincount", torch.bincount))
    for _ in range(2):  # the second step routes with the state the first one's update left
        routing = router.train()(x_BTD)
        (routing.weight.sum() + routing.aux_loss).backward()
        router.update_after_step()
        router.eval()(x_BTD)
    monkeypatch.undo()
    assert calls == [], calls
    router.check_finite = True  # the debug check does read the host: the counter would see it
    monkeypatch.setattr(torch.Tensor, "__bool__", counting("__bool__", torch.Tensor.__bool__))
    router(x_BTD)
    monkeypatch.undo()
    assert calls == ["__bool__"]
