"""moe.integrations.hf: our routers inside transformers MoE models (tiny random configs, no downloads).

Equivalence with router="topk" per family, shared (not copied) weights, the Triton backend
inside a swapped model, training with this package's loop, and the audit's verdicts.
"""

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import need, needs
from helpers import HF_RUN

need("transformers", "hf")

from transformers import AutoModelForCausalLM  # noqa: E402

import moe  # noqa: E402
from moe import list_routers  # noqa: E402
from moe.agreement import agreement_figures  # noqa: E402
from moe.audit import audit  # noqa: E402
from moe.audit import cli as audit_cli  # noqa: E402
from moe.data import load_corpus  # noqa: E402
from moe.integrations.hf import (  # noqa: E402
    FAMILIES,
    TINY_CONFIGS,
    HFCausalLM,
    HFMoEBlock,
    build_hf_model,
    decoding,
    load_hf_model,
    swap_moe_blocks,
    swapped_routings,
    tiny_config,
)
from moe.training import TrainConfig, load_export, train  # noqa: E402

V = 64
ROOT = Path(__file__).resolve().parents[1]
# (tiny config, norm_topk_prob): families that read the renormalisation from their config run both ways
CASES = [
    (name, norm)
    for name, (model_type, _) in TINY_CONFIGS.items()
    for norm in ((False, True) if model_type not in ("mixtral", "minimax", "granitemoe") else (None,))
]


def tiny_model(name: str, norm: bool | None = None, seed: int = 0):
    torch.manual_seed(seed)
    overrides = {} if norm is None else {"norm_topk_prob": norm}
    model = AutoModelForCausalLM.from_config(tiny_config(name, V, **overrides), dtype=torch.float32)
    with torch.no_grad():  # transformers initialises with std 0.02; larger gates make the routing decisive
        for block in model.modules():
            if type(block).__name__ in FAMILIES:
                getattr(block, FAMILIES[type(block).__name__].gate_attr).weight.normal_(0, 0.5)
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def assert_rel_close(got, want, rtol, what=""):
    err = (got - want).abs()
    assert err.max() <= rtol * want.abs().max(), (
        f"{what} max {err.max():.2e} mean {err.mean():.2e} (scale {want.abs().max():.2e})"
    )


def test_every_tiny_config_is_a_supported_family():
    for name in TINY_CONFIGS:
        blocks = {type(m).__name__ for m in tiny_model(name).modules() if hasattr(m, "experts")}
        assert blocks and blocks <= set(FAMILIES), (name, blocks)


@pytest.mark.parametrize("name,norm", CASES)
def test_topk_swap_reproduces_the_family(name, norm):
    model = tiny_model(name, norm)
    ids = torch.randint(0, V, (3, 12))
    want = logits(model, ids)
    swap_moe_blocks(model, "topk")
    assert sum(isinstance(m, HFMoEBlock) for m in model.modules()) == 2
    # fp32 both ways; the same matmuls on the same weights, summed in another order: rounding only
    assert_rel_close(logits(model, ids), want, 1e-5, name)
    routings = swapped_routings(model)
    assert len(routings) == 2 and all(r.num_assignments == 3 * 12 * 2 for r in routings)
    assert all((r.stats["tokens_per_expert"] > 0).sum() >= 2 for r in routings)  # routing really chooses


def test_wrong_normalisation_is_visible():
    # the equivalence test can fail: renormalising a family that does not changes the logits
    model = tiny_model("olmoe-tiny", norm=False)
    ids = torch.randint(0, V, (2, 12))
    want = logits(model, ids)
    swap_moe_blocks(model, "topk", normalize=True)
    assert (logits(model, ids) - want).abs().max() > 1e-3 * want.abs().max()


def deepseek_v3(seed: int = 0):
    """The tiny DeepSeek-V3 (8 experts in 4 groups, 2 groups and 2 experts per token, one
    shared expert) with a correction bias that changes choices."""
    model = tiny_model("deepseek-v3-tiny", norm=True, seed=seed)
    with torch.no_grad():
        for block in model.modules():
            if type(block).__name__ == "DeepseekV3MoE":
                block.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


def original_choices(model, ids) -> list[set]:
    """Each token's experts as transformers' DeepseekV3TopkRouter picks them, per MoE block."""
    seen = []
    hooks = [
        b.gate.register_forward_hook(lambda m, i, out: seen.append([set(r) for r in out[2].tolist()]))
        for b in model.modules()
        if type(b).__name__ == "DeepseekV3MoE"
    ]
    logits(model, ids)
    for h in hooks:
        h.remove()
    return seen


def test_deepseek_v3_swap_routes_exactly_as_the_original():
    """Sigmoid scores, the correction bias (our balance bias, the same tensor), group-limited
    top-k, renormalisation and routed_scaling_factor: the same experts for every token, the
    same logits to rounding; dropping the groups or the bias changes both (the controls)."""
    model = deepseek_v3()
    ids = torch.randint(0, V, (3, 12))
    want, want_choices = logits(model, ids), original_choices(model, ids)
    swapped = swap_moe_blocks(copy.deepcopy(model), "topk")
    assert_rel_close(logits(swapped, ids), want, 1e-5, "deepseek-v3")
    got_choices = [[set(e.tolist()) for e in r.expert.view(-1, 2)] for r in swapped_routings(swapped)]
    assert got_choices == want_choices
    block = next(m for m in swapped.modules() if isinstance(m, HFMoEBlock))
    router = block.moe.router
    assert (router.gate_fn, router.num_expert_groups, router.num_limited_groups, router.route_scale) == (
        "sigmoid",
        4,
        2,
        2.5,
    )
    hf_gate = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter")
    assert router.balance_bias.data_ptr() != hf_gate.e_score_correction_bias.data_ptr()  # a deep copy
    assert block.shared_expert is not None and block.shared_expert_gate is None
    ungrouped = swap_moe_blocks(copy.deepcopy(model), "topk", num_expert_groups=None, num_limited_groups=None)
    unbiased = swap_moe_blocks(copy.deepcopy(model), "topk")
    for m in unbiased.modules():
        if isinstance(m, HFMoEBlock):
            m.moe.router.balance_bias.zero_()
    for control in (ungrouped, unbiased):
        assert (logits(control, ids) - want).abs().max() > 1e-3 * want.abs().max()


def test_deepseek_v3_bias_is_shared_and_trains_loss_free():
    model = deepseek_v3()
    gates = [m.gate for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    before = [g.e_score_correction_bias.clone() for g in gates]
    swap_moe_blocks(model, "topk", balance_rate=0.01, aux_loss_coef=0.0, seq_aux_loss_coef=1e-4).train()
    routers = [m.moe.router for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert all(r.balance_bias is g.e_score_correction_bias for r, g in zip(routers, gates))
    ids = torch.randint(0, V, (2, 12))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    (out.loss + sum(r.aux_loss for r in swapped_routings(model))).backward()
    moe.update_routers(model)
    assert all(not torch.equal(g.e_score_correction_bias, b) for g, b in zip(gates, before))


@pytest.mark.parametrize("name", ["olmoe-tiny", "qwen2-moe-tiny"])
def test_topk_swap_gives_the_same_gradients(name):
    original = tiny_model(name, norm=True).train()
    swapped = swap_moe_blocks(copy.deepcopy(original), "topk").train()
    ids = torch.randint(0, V, (2, 10))
    for model in (original, swapped):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    rename = {".moe.router.gate.weight": ".gate.weight", ".moe.experts.": ".experts."}
    grads = {}
    for n, p in swapped.named_parameters():
        for new, old in rename.items():
            n = n.replace(new, old)
        grads[n] = p.grad
    for n, p in original.named_parameters():
        assert_rel_close(grads[n], p.grad, 1e-5, n)


def test_swap_shares_every_parameter_without_copying():
    model = tiny_model("qwen2-moe-tiny", norm=True)
    before = {id(p): p.data_ptr() for p in model.parameters()}
    swap_moe_blocks(model, "ec_threshold")
    after = {id(p): p.data_ptr() for p in model.parameters()}
    assert after == before  # the same parameter objects on the same storage, none added
    block = next(m for m in model.modules() if isinstance(m, HFMoEBlock))
    experts = block.moe.experts
    assert experts.w_gate.data_ptr() == experts.gate_up_proj.data_ptr()
    assert experts.w_up.data_ptr() == experts.gate_up_proj[:, experts.d_ff :].data_ptr()
    assert experts.w_down.data_ptr() == experts.down_proj.data_ptr()
    assert block.shared_expert is not None and block.shared_expert_gate is not None


@needs("triton", "triton")
def test_triton_backend_inside_a_swapped_model():
    # the Triton interpreter on CPU is slow: one tiny model, a short sequence
    model = tiny_model("olmoe-tiny", norm=True)
    reference = swap_moe_blocks(copy.deepcopy(model), "topk", backend="torch")
    swap_moe_blocks(model, "topk", backend="triton")
    assert all(m.moe.backend == "triton" for m in model.modules() if isinstance(m, HFMoEBlock))
    ids = torch.randint(0, V, (2, 6))
    outs = []
    for m in (reference, model):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        outs.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (want, want_grads), (got, got_grads) = outs
    assert_rel_close(got, want, 1e-5, "logits")
    for n, g in want_grads.items():
        assert_rel_close(got_grads[n], g, 1e-4, n)  # fp32 sums in another order through backward


def test_transformers_own_aux_loss_is_switched_off_and_the_core_never_imports_transformers():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe-tiny", V, output_router_logits=True))
    swap_moe_blocks(model, "topk")
    assert model.config.output_router_logits is False
    ids = torch.randint(0, V, (2, 8))
    assert torch.isfinite(model(input_ids=ids, labels=ids, use_cache=False).loss)
    code = "import sys, moe, moe.training, moe.audit, moe.eval; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_hf_causal_lm_interface_and_aux_loss():
    model = HFCausalLM(swap_moe_blocks(tiny_model("mixtral-tiny"), "ec_threshold", aux_loss_coef=0.1))
    idx = torch.randint(0, V, (2, 9))
    out = model(idx[:, :-1], idx[:, 1:])
    assert out.logits.shape == (2, 8, V) and len(out.routings) == 2
    torch.testing.assert_close(out.aux_loss, out.routings[0].aux_loss + out.routings[1].aux_loss)
    assert out.aux_loss > 0
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)
    (out.loss + out.aux_loss).backward()
    gate = model.hf.model.layers[0].mlp.moe.router.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


@pytest.mark.parametrize("router", list_routers())
def test_every_router_swaps_in_and_trains_a_step(router):
    model = HFCausalLM(swap_moe_blocks(tiny_model("qwen3-moe-tiny", norm=True), router)).train()
    idx = torch.randint(0, V, (2, 12))
    out = model(idx[:, :-1], idx[:, 1:])
    (out.loss + out.aux_loss).backward()
    gate = model.hf.model.layers[1].mlp.moe.router.gate.weight
    assert torch.isfinite(out.aux_loss) and gate.grad is not None and gate.grad.abs().sum() > 0
    moe.update_routers(model)


def generate_with_logits(model, prompt_BT, n):
    out = model.generate(
        prompt_BT,
        max_new_tokens=n,
        do_sample=False,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, 1)  # [B, T0 + n], [B, n, V]


def full_forward_logits(model, seq_BT, n):
    """The logits that chose each of the last n tokens, from one full-sequence forward."""
    return logits(model, seq_BT)[:, -n - 1 : -1]


@pytest.mark.parametrize(
    "router, options",
    [("capacity", {"capacity_scope": "prefix", "capacity_factor": 0.5}), ("ec_threshold", {}), ("topk", {})],
)
def test_generate_inside_decoding_equals_the_full_forward(router, options):
    model = swap_moe_blocks(tiny_model("olmoe-tiny", norm=True), router, **options)
    prompt = torch.randint(0, V, (2, 5))
    with decoding(model, batch_size=2):
        seq, step_logits = generate_with_logits(model, prompt, 12)
    assert all(b.decode_state is None for b in model.modules() if isinstance(b, HFMoEBlock))
    full = full_forward_logits(model, seq, 12)
    assert_rel_close(step_logits, full, 1e-5, f"{router}: generate inside decoding vs full forward")


def test_swapped_deepseek_v3_generates_with_its_cache_as_the_full_forward():
    model = swap_moe_blocks(deepseek_v3(), "topk")
    prompt = torch.randint(0, V, (2, 5))
    with decoding(model, batch_size=2):
        seq, step_logits = generate_with_logits(model, prompt, 10)
    assert_rel_close(step_logits, full_forward_logits(model, seq, 10), 1e-5, "deepseek-v3 generate vs full forward")


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_several_new_tokens_per_call_through_the_cache_are_the_full_forward(name):
    """Chunked decoding, as the causal evaluation does it (``stride`` new tokens a call): the
    tiny DeepSeek-V3 failed here while it kept 2 KV heads of 4 (transformers' MLA)."""
    model = build_hf_model(name, "topk", {}, V, 0).eval()
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        for chunk in (1, 3, 6):
            cache = model.init_cache(2, 12)
            got = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits for s in range(0, 12, chunk)], 1)
            assert_rel_close(got, full, 1e-5, f"{name}: {chunk} tokens a call vs full forward")


def test_generate_outside_decoding_misroutes_a_prefix_capacity_router():
    # Each cached call routes its new token as a sequence of its own (position 0, capacity >= 1):
    # nothing is dropped, while the full forward drops. The context is what makes it exact.
    model = swap_moe_blocks(
        tiny_model("olmoe-tiny", norm=True), "capacity", capacity_scope="prefix", capacity_factor=0.5
    )
    prompt = torch.randint(0, V, (2, 5))
    with pytest.warns(UserWarning, match="generating outside decoding"):
        seq, step_logits = generate_with_logits(model, prompt, 12)
    assert (step_logits - full_forward_logits(model, seq, 12)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="not decode-consistent"):
        with decoding(swap_moe_blocks(tiny_model("olmoe-tiny"), "expert_choice"), batch_size=2):
            pass


def test_hf_causal_lm_decodes_through_its_cache():
    # a prefix-scoped capacity router: its decode state (kept counts) must follow the cache
    model = HFCausalLM(
        swap_moe_blocks(tiny_model("olmoe-tiny", norm=True), "capacity", capacity_scope="prefix", capacity_factor=0.5)
    )
    ids = torch.randint(0, V, (2, 10))
    cache = model.init_cache(2)
    with torch.no_grad():
        chunks = [model(ids[:, :4], cache=cache).logits] + [
            model(ids[:, t : t + 1], cache=cache).logits for t in range(4, 10)
        ]
        full = model(ids).logits
    assert cache.length == 10 and all(b.decode_state is None for b in model.hf.modules() if isinstance(b, HFMoEBlock))
    assert_rel_close(torch.cat(chunks, 1), full, 1e-5, "cached chunks vs full forward")
    with pytest.raises(ValueError, match="not decode-consistent"):
        HFCausalLM(swap_moe_blocks(tiny_model("olmoe-tiny"), "expert_choice")).init_cache(2)


def test_a_transformers_generation_replays_into_the_training_forward_and_has_agreement_figures():
    swapped = swap_moe_blocks(tiny_model("qwen3-moe-tiny", norm=True), "topk")
    prompt = torch.randint(0, V, (2, 5))
    with decoding(swapped, batch_size=2), moe.record_routing(swapped) as record:
        seq, step_logits = generate_with_logits(swapped, prompt, 8)
    assert (record.batch_size, record.length, record.num_layers) == (2, 12, 2)
    model = HFCausalLM(swapped)
    with torch.no_grad():
        for block in swapped.modules():  # the trainer's gates moved on: only replay keeps the sampled routing
            if isinstance(block, HFMoEBlock):
                block.moe.router.gate.weight.add_(0.5 * torch.randn_like(block.moe.router.gate.weight))
    with torch.no_grad(), moe.replay_routing(model, record), moe.record_routing(model) as seen:
        model(seq[:, :-1])
    assert torch.equal(seen.experts, record.experts)
    with torch.no_grad(), moe.record_routing(model) as own:
        model(seq[:, :-1])
    assert not torch.equal(own.experts, record.experts), "the moved gates must route differently"
    figures = agreement_figures(model, seq[:, :-1])
    assert figures["decode"].share == 1.0 and figures["decode"].compared == "KV-cache decoding, one token at a time"
    assert figures["chunked_prefill"].share == 1.0 and figures["batch"].share == 1.0
    assert all(0.0 <= f.share <= 1.0 for f in figures.values())


def test_swap_errors():
    with pytest.raises(ValueError, match="no sparse MoE block"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="unknown router"):
        swap_moe_blocks(tiny_model("olmoe-tiny"), "nope")
    torch.manual_seed(0)
    jittery = AutoModelForCausalLM.from_config(tiny_config("mixtral-tiny", V, router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="router_jitter_noise"):
        swap_moe_blocks(jittery)
    four_x = type("MixtralSparseMoeBlock", (torch.nn.Module,), {})()  # transformers 4.x: one module per expert
    four_x.gate, four_x.experts = (
        torch.nn.Linear(8, 4, bias=False),
        torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4)),
    )
    with pytest.raises(ValueError, match="5.x layout"):
        swap_moe_blocks(torch.nn.Sequential(four_x))
    with pytest.raises(ValueError, match="neither a built-in tiny config"):
        load_hf_model("no/such/dir", V)
    with pytest.raises(ValueError, match="no model overrides"):
        TrainConfig.flat(hf_model="olmoe-tiny", model={"d_model": 32})


def test_local_directory_loads_weights_or_config(tmp_path):
    original = tiny_model("qwen3-moe-tiny", norm=True)
    original.save_pretrained(tmp_path / "weights")
    original.config.save_pretrained(tmp_path / "config_only")
    ids = torch.randint(0, V, (2, 8))
    loaded = build_hf_model(str(tmp_path / "weights"), "topk", {}, V)
    assert_rel_close(loaded(ids).logits.detach(), logits(original, ids), 1e-5, "loaded")
    fresh = load_hf_model(str(tmp_path / "config_only"), V, seed=3)
    assert type(fresh) is type(original) and not torch.equal(fresh.lm_head.weight, original.lm_head.weight)
    unread = load_hf_model(str(tmp_path / "weights"), V, seed=3, weights=False)  # what a meta build asks for
    assert torch.equal(unread.lm_head.weight, fresh.lm_head.weight)
    with pytest.raises(ValueError, match="vocab_size"):
        load_hf_model(str(tmp_path / "weights"), V + 1)


@pytest.mark.parametrize("router,options", [("ec_threshold", {}), ("capacity", {"capacity_scope": "prefix"})])
def test_swapped_olmoe_trains_with_the_loop(router, options):
    corpus = load_corpus("stdlib", 0.1, 100_000)
    cfg = TrainConfig.flat(hf_model="olmoe-tiny", router=router, router_options=options, steps=25, **HF_RUN)
    res = train(cfg, corpus)
    losses = [r["loss"] for r in res.history]
    assert abs(losses[0] - math.log(256)) < 0.3, losses[0]  # random init: uniform over the bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert all(r["aux_loss"] > 0 for r in res.history)
    assert len(res.history[-1]["tokens_per_expert"]) == 2  # two swapped blocks' loads
    assert isinstance(res.model, HFCausalLM)
    # a causal, decode-consistent router: decoding (prefix forwards) sees what training saw
    assert abs(res.final_eval["leakage_gap"]) < 1e-5


@pytest.mark.parametrize(
    "spec, architecture", [("olmoe-tiny", "OlmoeForCausalLM"), ("qwen2-moe-tiny", "Qwen2MoeForCausalLM")]
)
def test_the_banner_names_the_transformers_model(spec, architecture, capsys):
    corpus = load_corpus("stdlib", 0.1, 100_000)
    train(TrainConfig.flat(hf_model=spec, steps=1, **{**HF_RUN, "log_every": 1}), corpus)
    banner = capsys.readouterr().out.splitlines()[0]
    assert f"model: transformers {architecture} ({spec}), " in banner, banner


def test_swapped_model_resumes_exactly_from_a_checkpoint(tmp_path):
    # the swapped blocks' router state (ec_threshold's thresholds) lives in the checkpoint too
    corpus = load_corpus("stdlib", 0.1, 100_000)
    common = dict(
        hf_model="qwen2-moe-tiny",
        router="ec_threshold",
        seq_len=16,
        batch_size=4,
        eval_windows=2,
        eval_batch_size=2,
        causal_stride=8,
        warmup_steps=1,
        log_every=0,
        progress=False,
    )
    full = train(TrainConfig.flat(steps=4, **common), corpus)
    # stopped after 2 steps of the 4-step schedule: an interrupted run (a resume keeps its schedule)
    train(TrainConfig.flat(steps=2, schedule_steps=4, checkpoint_dir=str(tmp_path), **common), corpus)
    resumed = train(TrainConfig.flat(steps=4, checkpoint_dir=str(tmp_path), resume=True, **common), corpus)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[2:]]


@pytest.mark.parametrize("router,leaks", [("topk", False), ("ec_threshold", False), ("expert_choice", True)])
def test_audit_of_a_swapped_model_reaches_the_routers_claims(router, leaks):
    model = HFCausalLM(swap_moe_blocks(tiny_model("olmoe-tiny", norm=True), router))
    report = audit(model, torch.randint(0, V, (2, 12)), trials=1, seed=0)
    assert report.leaks is leaks and report.violations == []
    assert report.decode_consistent is not leaks


def test_audit_cli_with_a_factory(tmp_path, capsys):
    target = tmp_path / "swapped.py"
    target.write_text(
        "from transformers import AutoModelForCausalLM\n"
        "from moe.integrations.hf import HFCausalLM, swap_moe_blocks, tiny_config\n"
        "def build(router='expert_choice'):\n"
        "    model = AutoModelForCausalLM.from_config(tiny_config('qwen3-moe-tiny', 64))\n"
        "    return HFCausalLM(swap_moe_blocks(model, router))\n"
        "def causal():\n"
        "    return build('ec_threshold')\n"
    )
    argv = ["--no-progress", "--trials", "1", "--input", "tokens:2,10,64"]
    assert audit_cli.main([*argv, "--target", f"{target}:causal"]) == 0
    assert audit_cli.main([*argv, "--target", f"{target}:build"]) == 1
    assert "leak" in capsys.readouterr().out


def test_an_exported_hf_run_loads_and_samples_as_the_trained_model(tmp_path, capsys):
    """``--export-model`` of a ``--hf-model`` run: the file rebuilds the swapped model from its
    transformers config (DeepSeek-V3's groups and correction bias included), with the trained
    weights; it samples through its cache as greedy full forwards pick, and generate.py prints it."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import generate

    corpus = load_corpus("stdlib", 0.1, 100_000)
    run = dict(hf_model="deepseek-v3-tiny", router="topk", steps=2, wandb_mode="disabled", **HF_RUN)
    trained = train(TrainConfig.flat(**run, checkpoint_dir=str(tmp_path), export_model=True), corpus).model.eval()
    model = load_export(tmp_path / "model.pt")
    assert isinstance(model, HFCausalLM) and model.architecture == "DeepseekV3ForCausalLM"
    assert not model.training and model.vocab_size == corpus.vocab_size
    ids = torch.randint(0, corpus.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained(ids).logits, rtol=0, atol=0)
        seq = model.generate(ids[:, :5], 7, temperature=0)
        want = ids[:, :5]
        for _ in range(7):
            want = torch.cat([want, model(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, want)
    generate.main([str(tmp_path / "model.pt"), "--prompt", "def f", "--max-new-tokens", "6", "--temperature", "0"])
    sample = model.generate(torch.tensor([corpus.encode("def f")]), 6, temperature=0)[0, 5:].tolist()
    assert capsys.readouterr().out.splitlines()[2:4] == ["--- sample: 6 new tokens ---", corpus.decode(sample)]


def test_hash_routing_reads_the_models_input_ids_in_a_full_forward_and_through_the_cache():
    """A swapped model hands its input_ids to the blocks: each token's experts are the table's row
    of its id, and greedy decoding through transformers' cache gives the full forward's logits."""
    hf = swap_moe_blocks(tiny_model("qwen3-moe-tiny", norm=True), "hash").eval()
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        hf(input_ids=idx)
    for block in [m for m in hf.modules() if isinstance(m, HFMoEBlock)]:
        table_BTE = torch.zeros(2, 10, block.moe.num_experts, dtype=torch.bool)
        table_BTE.scatter_(2, block.moe.router.tid2eid[idx], True)
        assert torch.equal(block.routing.mask(), table_BTE) and block.token_ids_BT is None
    with torch.no_grad():
        seq, logits = generate_with_logits(hf, idx[:, :4], 5)
        torch.testing.assert_close(logits, full_forward_logits(hf, seq, 5), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="call the model with input_ids, not inputs_embeds"):
        hf(inputs_embeds=torch.randn(2, 4, hf.config.hidden_size))
