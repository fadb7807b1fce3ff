"""The zoo (``moe-audit --zoo``) against verdicts stated from reading transformers' own code.

Each expectation below cites the code that decides it (transformers 5.25,
``transformers/models/<family>/modeling_<family>.py``). The default suite audits a few families
(one module-scoped run); the whole zoo is a ``slow`` test. They run where the installed
transformers is one the ``[zoo]`` extra allows (an older one has fewer blocks than stated here).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from extras import INSTALL, need
from packaging.requirements import Requirement
from test_install import project_extras

transformers = need("transformers", "zoo")
(ZOO_TRANSFORMERS,) = map(Requirement, project_extras()["zoo"])
if not ZOO_TRANSFORMERS.specifier.contains(transformers.__version__):
    pytest.skip(
        f"transformers {transformers.__version__} does not satisfy the [zoo] extra ({ZOO_TRANSFORMERS}; {INSTALL['zoo']})",
        allow_module_level=True,
    )

from test_zoo_frameworks import Expect  # noqa: E402

from moe.audit import cli  # noqa: E402
from moe.audit.report import BATCH_PROBE  # noqa: E402
from moe.audit.zoo import FRAMEWORKS, ZooRow, audit_zoo, build, discover, zoo_json, zoo_markdown  # noqa: E402
from moe.audit.zoo import run as zoo_run  # noqa: E402


def per_token(why: str) -> Expect:
    """Routing reads only the token's own hidden state and nothing caps an expert's load."""
    return Expect((), True, True, why)


def not_standalone(why: str) -> Expect:
    return Expect((), True, True, why, runs=False)


SIGMOID_GROUPS = "sigmoid scores + e_score_correction_bias (a fixed buffer), top-k inside the top groups of the token's own scores; no capacity"
SOFTMAX_TOPK = "softmax top-k of the token's own logits, experts loop over index_add_; no capacity"

EXPECTED: dict[str, Expect] = {
    "AfmoeSparseMoeBlock": per_token(
        f"AfmoeTokenChoiceRouter: {SIGMOID_GROUPS.replace('inside the top groups of', 'of')}"
    ),
    "AriaTextMoELayer": per_token(
        "AriaTextTopKRouter: topk of the logits then softmax, per token; shared MLP is dense"
    ),
    "AXK1MoE": per_token(f"AXK1TopkRouter: {SIGMOID_GROUPS}"),
    "AXK2MoE": per_token(f"AXK2TopkRouter: {SIGMOID_GROUPS}"),
    "BailingHybridMoE": per_token(f"BailingHybridTopkRouter: {SIGMOID_GROUPS}"),
    "BeamMoE": per_token(f"BeamTopKRouter: {SIGMOID_GROUPS}"),
    "Cohere2MoeSparseMoeBlock": per_token(
        "Cohere2MoeTopKRouter: topk of the token's logits, then softmax or sigmoid over the k"
    ),
    "DbrxFFN": per_token("DbrxRouter: softmax top-k per token; moe_jitter_eps is None by default; no capacity"),
    "DeepseekOcr2TextMoe": per_token("DeepseekOcr2TextTopkRouter: softmax, group-limited top-k per token; no capacity"),
    "DeepseekV2Moe": per_token("DeepseekV2TopkRouter: softmax, group-limited top-k per token; no capacity"),
    "DeepseekV3MoE": per_token(f"DeepseekV3TopkRouter + route_tokens_to_experts: {SIGMOID_GROUPS}"),
    "DeepseekV32MoE": per_token(f"DeepseekV32TopkRouter: {SIGMOID_GROUPS}"),
    "DeepseekV4SparseMoeBlock": per_token(
        "DeepseekV4TopKRouter (last layer: 'moe', not 'hash_moe'): score_fn top-k + bias per token"
    ),
    "DiffusionGemmaEncoderTextLayer": not_standalone(
        "a decoder layer with the MoE inline; forward needs position_embeddings"
    ),
    "DiffusionGemmaDecoderTextLayer": not_standalone(
        "a decoder layer with the MoE inline; forward needs position_embeddings"
    ),
    "DogeCDMoE": Expect(
        ("train", "eval"),
        False,
        False,
        "router_gate(x).view(2, bsz * seq_len, -1) splits the [B*T, 2K] logits along the token axis, so token n "
        "scores with the logits of tokens n//2 and (B*T+n)//2 (the code's comment admits it is not causal)",
    ),
    "Dots1MoE": per_token(f"Dots1TopkRouter: {SIGMOID_GROUPS}"),
    "Dots3NoteTextMoE": per_token(f"Dots3NoteTextTopkRouter: {SIGMOID_GROUPS}"),
    "Dots3NoteVisionMoE": per_token("Dots3NoteVisionTopKRouter: sigmoid + bias top-k per token; no capacity"),
    "Ernie4_5_MoeSparseMoeBlock": per_token(
        "Ernie4_5_MoeTopKRouter: softmax, topk of moe_statics(weights) (a fixed bias) per token"
    ),
    "Ernie4_5_VLMoeSparseMoeBlock": per_token(
        "Ernie4_5_VLMoeMoeTopKRouter: softmax top-k per token, fixed bias buffer"
    ),
    "ErgoMoE": per_token(
        "ErgoTopkRouter: sigmoid + e_score_correction_bias top-k per token (no groups); each route's expert output "
        "gets its expert's RMSNorm, the shared expert is dense; no capacity"
    ),
    "ExaoneMoeSparseMoEBlock": per_token(f"ExaoneMoeTopkRouter: {SIGMOID_GROUPS}"),
    "FlexOlmoSparseMoeBlock": per_token(f"FlexOlmoTopKRouter: {SOFTMAX_TOPK}"),
    "FlintSparseMoeBlock": per_token("FlintTopKRouter: sigmoid top-k per token; shared expert dense"),
    "Gemma4TextDecoderLayer": not_standalone("a decoder layer with the MoE inline; forward needs position_embeddings"),
    "Glm4MoeMoE": per_token(f"Glm4MoeTopkRouter: {SIGMOID_GROUPS}"),
    "Glm4MoeLiteMoE": per_token(f"Glm4MoeLiteTopkRouter: {SIGMOID_GROUPS}"),
    "Glm4vMoeTextMoE": per_token(f"Glm4vMoeTextTopkRouter: {SIGMOID_GROUPS}"),
    "Glm5NextTextMoE": per_token(f"Glm5NextTextTopkRouter: {SIGMOID_GROUPS}"),
    "GlmMoeDsaMoE": per_token(f"GlmMoeDsaTopkRouter: {SIGMOID_GROUPS}"),
    "GptOssMLP": per_token("GptOssTopKRouter: topk of linear logits (+bias), softmax over the k; no capacity"),
    "GraniteMoeMoE": per_token("GraniteMoeTopKRouter: topk of logits, softmax over the k, per token"),
    "GraniteMoeSWAMoE": per_token("GraniteMoeSWATopKRouter: topk of logits, softmax over the k, per token"),
    "GraniteMoeHybridMoE": per_token("GraniteMoeHybridTopKRouter: topk of logits, softmax over the k, per token"),
    "GraniteMoeSharedMoE": per_token(
        "GraniteMoeSharedTopKRouter: topk of logits, softmax over the k; shared MLP dense"
    ),
    "HunYuanMoEV1Moe": per_token("HunYuanMoEV1Gate: softmax top-k per token; no capacity"),
    "HYV3MoE": per_token("HYV3TopKRouter: sigmoid + bias top-k per token; no capacity"),
    "HYV4MoE": per_token(f"HYV4TopkRouter: {SIGMOID_GROUPS}"),
    "HYV4VLMoE": per_token(f"HYV4VLTopkRouter: {SIGMOID_GROUPS}"),
    "InklingMoE": per_token(
        "InklingTopkRouter: sigmoid + bias top-k per token; shared experts sum over experts (dim 0), not tokens"
    ),
    "Inkling2SparseMoeBlock": per_token("Inkling2TopKRouter: score_fn(logits) + bias, topk(dim=-1) per token"),
    "Inkling2LoopSparseMoeBlock": per_token("Inkling2LoopTopKRouter: score_fn(logits) + bias, topk(dim=-1) per token"),
    "JambaSparseMoeBlock": per_token(f"JambaTopKRouter: {SOFTMAX_TOPK}"),
    "JetMoeMoE": per_token(
        "JetMoeTopKGating: topk(dim=1) of each token's logits; the sort only groups tokens by expert"
    ),
    "JetMoeMoA": not_standalone("mixture of attention heads: forward raises NotImplementedError (use map / reduce)"),
    "KimiLinearMoE": per_token(f"KimiLinearTopkRouter: {SIGMOID_GROUPS}"),
    "Kolibri1SparseMoeBlock": per_token("Kolibri1TopKRouter: sigmoid + bias top-k per token"),
    "Kolibri1_1SparseMoeBlock": per_token(
        "Kolibri1_1TopKRouter (Kolibri1's router): topk of logits + e_score_correction_bias per token, sigmoid of the k"
    ),
    "LagunaSparseMoeBlock": per_token("LagunaTopKRouter: softcapped sigmoid + bias top-k per token"),
    "LaraMiniSparseMoeBlock": per_token(f"LaraMiniTopKRouter: {SOFTMAX_TOPK}"),
    "Lfm2MoeSparseMoeBlock": per_token("Lfm2MoeTopKRouter: sigmoid + bias top-k per token"),
    "Llama4TextMoe": per_token(
        "Llama4Router: topk(dim=1) of the token's logits then sigmoid; the sum(dim=0) is over the k copies"
    ),
    "LongcatFlashMoE": per_token("LongcatFlashTopkRouter: softmax + bias top-k per token; zero experts are identities"),
    "MellumSparseMoeBlock": per_token(f"MellumTopKRouter: {SOFTMAX_TOPK}"),
    "MiMoV2FlashMoE": per_token(f"MiMoV2FlashTopkRouter: {SIGMOID_GROUPS}"),
    "MiniCPM5MoeMoE": per_token(f"MiniCPM5MoeTopkRouter: {SIGMOID_GROUPS}"),
    "MiniMaxSparseMoeBlock": per_token(f"MiniMaxTopKRouter: {SOFTMAX_TOPK}; jitter 0 by default"),
    "MiniMaxM2SparseMoeBlock": per_token("MiniMaxM2TopKRouter: sigmoid + bias top-k per token; jitter 0 by default"),
    "MiniMaxM3VLSparseMoeBlock": per_token("MiniMaxM3VLTopKRouter: sigmoid + bias top-k per token"),
    "Mistral4MoE": per_token("Mistral4TopkRouter: softmax, group-limited top-k per token"),
    "MistralLarge4TextMoE": per_token("MistralLarge4TextTopkRouter: softmax, group-limited top-k per token"),
    "MixtralSparseMoeBlock": per_token(f"MixtralTopKRouter: {SOFTMAX_TOPK}; router_jitter_noise 0 by default"),
    "MuseSparkMoE": per_token("MuseSparkTopkRouter: score_fn + bias top-k per token"),
    "NemotronHMoE": per_token(f"NemotronHTopkRouter: {SIGMOID_GROUPS}"),
    "NllbMoeSparseMLP": Expect(
        ("train", "eval"),
        False,
        False,
        "NllbMoeTop2Router on the flattened B*T tokens: cumsum slots in position order over the whole batch, "
        "second choices queued after every first choice (locations2 += sum(top_1_mask)), eval capacity "
        "ceil(moe_eval_capacity_token_fraction * B*T)",
    ),
    "OlmoeSparseMoeBlock": per_token(f"OlmoeTopKRouter: {SOFTMAX_TOPK}"),
    "OpenAIPrivacyFilterMLP": per_token("OpenAIPrivacyFilterTopKRouter: topk of logits, softmax over the k, per token"),
    "PhimoeSparseMoeBlock": per_token(
        "sparsemixer: two masked maxes of the token's own scores (Gumbel-sampled per token in training)"
    ),
    "Qwen2MoeSparseMoeBlock": per_token(
        f"Qwen2MoeTopKRouter: {SOFTMAX_TOPK}; shared expert gated by sigmoid per token"
    ),
    "Qwen3_5MoeSparseMoeBlock": per_token(f"Qwen3_5MoeTopKRouter: {SOFTMAX_TOPK}; sigmoid-gated shared expert"),
    "Qwen3MoeSparseMoeBlock": per_token(f"Qwen3MoeTopKRouter: {SOFTMAX_TOPK}"),
    "Qwen3NextSparseMoeBlock": per_token(f"Qwen3NextTopKRouter: {SOFTMAX_TOPK}; sigmoid-gated shared expert"),
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": per_token(f"Qwen3OmniMoeThinkerTextTopKRouter: {SOFTMAX_TOPK}"),
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": per_token(
        f"Qwen3OmniMoeTalkerTextTopKRouter: {SOFTMAX_TOPK}; gated shared expert"
    ),
    "Qwen3VLMoeTextSparseMoeBlock": per_token(f"Qwen3VLMoeTextTopKRouter: {SOFTMAX_TOPK}"),
    "Qwen4ExpTextSparseMoeBlock": per_token(f"Qwen4ExpTextTopKRouter: {SOFTMAX_TOPK}; gated shared expert"),
    "SolarOpenMoE": per_token(f"SolarOpenTopkRouter: {SIGMOID_GROUPS}"),
    "Step3p7SparseMoeBlock": per_token("Step3p7TopKRouter: sigmoid + bias top-k per token"),
    "SwitchTransformersSparseMLP": per_token(
        "SwitchTransformersTop1Router routes the unflattened [B, T, D]: cumsum over dim=-2 (the sequence) gives slots "
        "in position order against a fixed expert_capacity, so a token is dropped only by earlier tokens of its own "
        "sequence (drops by position, but causal and decode-consistent)"
    ),
    "UnlimitedOcrTextMoe": per_token("UnlimitedOcrTextTopkRouter: softmax, group-limited top-k per token"),
    "ZayaSparseMoeBlock": per_token(
        "ZayaRouter: router MLP on the token's own down-projection, softmax + balancing bias, topk(dim=-1)"
    ),
    "MixtralForCausalLM": per_token("causal attention mask + per-token MixtralSparseMoeBlock"),
    "OlmoeForCausalLM": per_token("causal attention mask + per-token OlmoeSparseMoeBlock"),
    "Qwen2MoeForCausalLM": per_token("causal attention mask + per-token Qwen2MoeSparseMoeBlock"),
    "DeepseekV3ForCausalLM": per_token("causal attention mask (MLA) + per-token DeepseekV3MoE"),
    "GptOssForCausalLM": per_token("causal (and sliding-window) attention + per-token GptOssMLP"),
}

FAST_FAMILIES = ("mixtral", "switch_transformers", "nllb_moe", "doge", "jetmoe")
"""Audited in the default suite: plain top-k (block and whole LM), the two capacity blocks, the
leaky view, and a block that cannot run standalone."""


@pytest.fixture(scope="module")
def fast_rows() -> dict[str, ZooRow]:
    return {r.entry.cls_name: r for r in audit_zoo(families=FAST_FAMILIES)}


def _regime(row: ZooRow, mode: str) -> str:
    """The regime a mode was judged in ("fixed seed" for an audit that names none)."""
    return getattr(row.report, "regimes", {}).get(mode, "fixed seed")


def _disagreements(row: ZooRow) -> list[str]:
    """Where the zoo contradicts the code. Per mode: anything found that the code rules out; and
    anything the code has that a deterministic audit missed. In the distribution regime the audit
    bounds false positives (1% per mode) but its power at 8 draws per input is limited, so a miss
    there is tolerated as long as the row (all modes together) still shows the property. An
    audit without regimes judges stochastic training mode by a fixed seed, which dropout inside
    per-expert batches fools: its train verdicts are not judged for blocks random in training."""
    expect = EXPECTED[row.entry.cls_name]
    if not expect.runs:
        return [] if row.error else [f"expected not to run ({expect.why}), got a verdict"]
    if row.report is None or row.error:
        return [f"could not run: {row.error}"]
    rep, out = row.report, []
    modes = [m for m in rep.modes if not (m == "train" and row.built.train_noise and _regime(row, m) == "fixed seed")]
    found = {
        "a leak": {m: m in rep.leaks_in for m in modes},
        "batch interference": {
            m: any(p.leaks for p in rep.probes if p.name == BATCH_PROBE and p.mode == m) for m in modes
        },
        "decode inconsistency": {m: m in rep.decode_differs_in for m in modes},
    }
    expected = {
        "a leak": {m: m in expect.leaks_in for m in modes},
        "batch interference": dict.fromkeys(modes, not expect.batch_invariant),
        "decode inconsistency": dict.fromkeys(modes, not expect.decode_consistent),
    }
    for what, seen in found.items():
        if any(seen.values()) != any(expected[what].values()):
            out.append(f"{what} in some mode: {any(seen.values())}, expected {any(expected[what].values())}")
        for m in modes:
            if seen[m] and not expected[what][m]:
                out.append(f"{m}: {what} found, the code has none")
            elif expected[what][m] and not seen[m] and _regime(row, m) != "distribution":
                out.append(f"{m}: {what} missed ({_regime(row, m)} regime)")
    return [f"{d} ({expect.why})" for d in out]


def test_every_discovered_block_has_a_stated_verdict():
    found = {e.cls_name for e in discover()}
    assert found - set(EXPECTED) == set(), "new MoE blocks: read their code and add their verdicts to EXPECTED"
    assert set(EXPECTED) - found == set(), "EXPECTED names blocks the installed transformers no longer has"


def test_discovery_finds_blocks_by_code_not_by_a_list():
    from moe.audit.zoo.build import moe_block_names

    src = (
        "class FooSparseMoeBlock(nn.Module):\n    def __init__(self):\n        self.gate = R()\n        self.experts = E()\n"
        "class FooMLP(nn.Module):\n    def __init__(self):\n        self.gate_proj = L()\n"
        "class BarMoE(nn.Module):\n    def __init__(self):\n        self.router = R()\n        self.w = P()\n"
        "class BazExperts(nn.Module):\n    def __init__(self):\n        self.gate_up_proj = P()\n"
    )
    assert moe_block_names(src) == ["FooSparseMoeBlock", "BarMoE"]


def test_fast_families_agree_with_the_code(fast_rows):
    assert set(fast_rows) == {e.cls_name for e in discover(FAST_FAMILIES)}
    bad = {name: d for name, row in fast_rows.items() if (d := _disagreements(row))}
    assert not bad, bad


@pytest.mark.slow
def test_whole_zoo_agrees_with_the_code():
    rows = audit_zoo()
    bad = {r.entry.cls_name: d for r in rows if (d := _disagreements(r))}
    assert not bad, bad


def test_capacity_binds_at_the_audited_shape(fast_rows):
    """Switch and NLLB-MoE get capacities that really drop tokens (output rows of exact zeros:
    neither has a shared expert), in both modes; dropless blocks drop nothing."""
    for name in ("SwitchTransformersSparseMLP", "NllbMoeSparseMLP"):
        row = fast_rows[name]
        assert row.built.capacity and "expert_capacity=" in row.built.capacity
        assert min(row.dropped.values()) > 0, (name, row.dropped)
    assert fast_rows["MixtralSparseMoeBlock"].dropped == {"train": 0.0, "eval": 0.0}
    assert fast_rows["MixtralSparseMoeBlock"].built.capacity is None


def test_router_kind_is_read_from_the_code(fast_rows):
    kinds = {name: row.built.router_kind for name, row in fast_rows.items() if row.built is not None}
    assert kinds["MixtralSparseMoeBlock"].startswith("top-k; softmax scores")
    assert (
        kinds["SwitchTransformersSparseMLP"].startswith("top-1 (argmax)")
        and "capacity" in kinds["SwitchTransformersSparseMLP"]
    )
    assert "second choices queued after all first choices" in kinds["NllbMoeSparseMLP"]
    assert "split across the token axis" in kinds["DogeCDMoE"]
    assert "dropout" in fast_rows["SwitchTransformersSparseMLP"].built.train_noise
    assert fast_rows["SwitchTransformersSparseMLP"].regime == "train: distribution, eval: deterministic"
    assert fast_rows["MixtralSparseMoeBlock"].regime == "deterministic"


def test_json_and_markdown_rows(fast_rows):
    rows = list(fast_rows.values())
    targets = json.loads(zoo_json(rows))["targets"]
    assert len(targets) == len(rows)
    for t in targets:
        for key in ("library", "library_version", "class", "router_kind", "capacity", "regime", "error", "leaks"):
            assert key in t, key
        assert t["library"] == "transformers"
        if t["regime"] is None:
            assert t["leaks"] is None and t["error"], t
    moa = next(t for t in targets if t["class"] == "JetMoeMoA")
    assert moa["leaks"] is None and "NotImplementedError" in moa["error"]
    nllb = next(t for t in targets if t["class"] == "NllbMoeSparseMLP")
    assert nllb["leaks"] is True and nllb["capacity"].startswith("expert_capacity=")
    table = zoo_markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "not run: NotImplementedError" in table


def test_cli_zoo_flag(monkeypatch, tmp_path, capsys):
    real, real_frameworks = zoo_run.discover, zoo_run.audit_frameworks
    monkeypatch.setattr(zoo_run, "discover", lambda families=None: real(["jetmoe"]))
    monkeypatch.setattr(zoo_run, "audit_frameworks", lambda *a, **k: real_frameworks(*a, libraries=["torchtitan"], **k))
    out = tmp_path / "zoo.json"
    assert cli.main(["--zoo", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "`JetMoeMoE`" in printed and "could not run" in printed and "`TokenChoiceTopKRouter softmax top-2`" in printed
    )
    titan = {fc.name for fc in FRAMEWORKS if fc.library == "torchtitan"}
    assert {t["class"] for t in json.loads(out.read_text())["targets"]} == {"JetMoeMoE", "JetMoeMoA"} | titan
    assert cli.main(["--zoo", "--target", "x.py:y"]) == 2


def test_the_core_package_never_imports_transformers():
    code = "import sys, moe, moe.audit, moe.audit.cli, moe.audit.zoo; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_adapter_hands_blocks_a_fresh_contiguous_copy():
    """Switch scales its input in place in training (jitter) and Mixtral .view()s it: through the
    adapter the caller's tensor is untouched and non-contiguous inputs work, with the outputs the
    block gives on a contiguous copy."""
    entries = {e.cls_name: e for e in discover(["mixtral", "switch_transformers"]) if e.kind == "block"}
    switch = build(entries["SwitchTransformersSparseMLP"]).make().train()
    x = torch.randn(2, 8, 16)
    before = x.clone()
    switch(x)
    assert torch.equal(x, before)
    mixtral = build(entries["MixtralSparseMoeBlock"]).make().eval()
    x_TBD = torch.randn(8, 2, 16)
    x_BTD = x_TBD.transpose(0, 1)
    assert not x_BTD.is_contiguous()
    torch.testing.assert_close(mixtral(x_BTD), mixtral.block(x_BTD.contiguous()), rtol=0, atol=0)


def test_the_zoo_audits_every_output_a_block_or_model_returns(fast_rows):
    """A block's router logits beside its hidden output, a model's logits beside every layer's
    router logits: each audited (flat [B*T, E] read as tokens), or listed with why not."""
    lm = fast_rows["MixtralForCausalLM"].report
    assert lm.outputs == [
        "logits [2, 8, 64]",
        "router_logits.0 [16, 4] (rows b*T+t)",
        "router_logits.1 [16, 4] (rows b*T+t)",
    ]
    assert fast_rows["MixtralSparseMoeBlock"].report.outputs == ["output [2, 8, 16]"]
    doge = fast_rows["DogeCDMoE"].report
    assert doge.outputs == ["0 [2, 8, 16]"] and doge.outputs_not_audited[0].startswith("1 [2, 16, 2] (not per position")
    llama4 = next(e for e in discover(["llama4"]) if e.cls_name == "Llama4TextMoe")
    assert zoo_run.audit_entry(llama4, modes=("eval",)).report.outputs == ["0 [2, 8, 16]", "1 [16, 4] (rows b*T+t)"]
