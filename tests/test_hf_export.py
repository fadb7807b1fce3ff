"""moe.integrations.hf.export_pretrained: models trained here as Hugging Face checkpoint folders.

The reference is always the model that was exported: transformers' ``from_pretrained`` of the
folder must give its logits (a transformers architecture: to fp32 rounding; this package's own
class: exactly) and its greedy tokens. Tiny models, a few training steps, no downloads.
"""

import subprocess
import sys

import pytest
import torch
from extras import need
from helpers import HF_RUN, SMALL_RUN, SUBPROCESS_ENV

need("transformers", "hf")

from transformers import AutoModelForCausalLM  # noqa: E402

from moe.data import load_corpus  # noqa: E402
from moe.integrations.hf import (  # noqa: E402
    MoETransformerForCausalLM,
    build_hf_model,
    export_pretrained,
)
from moe.layer import update_routers  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402
from moe.training import TrainConfig, train  # noqa: E402

V = 64
MIXTRAL_ATOL = 1e-5
"""Logits of an export vs the exported model (fp32, logits of order 1) where transformers'
layers compute them: Mixtral computes our products in other orders (fused qkv vs three
projections, our SDPA vs transformers' attention, rotary tables in fp64 then rounded vs in
fp32), and a loaded swapped model may attend through another kernel than the one it was built
with; measured at most 3.6e-7 on these models."""


def trained(model, steps: int = 3, seed: int = 0):
    """``model`` after a few AdamW steps on random tokens (routers updated), in eval mode: weights
    and router state away from their initial values."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, model.vocab_size, (4, 17), generator=gen)
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        update_routers(model)
    return model.eval()


def tiny_preset(router: str = "topk", **fields):
    torch.manual_seed(0)
    cfg = preset("tiny", router=router, vocab_size=V, d_model=32, moe_d_ff=32, max_seq_len=32, **fields)
    return trained(MoETransformer(cfg))


def greedy(model, prompt, n: int) -> torch.Tensor:
    """Ours: n greedy tokens by full forwards of the whole sequence (what every router computes)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


def check_loaded(folder, ours, architecture: str, atol: float) -> None:
    """``from_pretrained(folder)`` is ``architecture``, in eval mode, with ``ours``' logits to
    ``atol`` and its greedy tokens through transformers' ``generate``."""
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == architecture and not loaded.training
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        want, got = ours(ids).logits, loaded(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"{architecture}: logits differ by {diff:.3g} (max), {(got - want).abs().mean():.3g} (mean)"
    new = loaded.generate(ids[:, :6], max_new_tokens=10, do_sample=False)
    assert torch.equal(new, greedy(ours, ids[:, :6], 10))


@pytest.mark.parametrize("tie", [True, False])
def test_a_softmax_topk_preset_exports_as_mixtral(tmp_path, tie):
    """No code of ours in the folder: Mixtral's own classes load it (the rotary layout, the
    fused qkv and the expert layout are converted; a missing conversion moves the logits by O(1))."""
    ours = tiny_preset(tie_embeddings=tie)
    assert export_pretrained(ours, tmp_path) == "MixtralForCausalLM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    check_loaded(tmp_path, ours, "MixtralForCausalLM", MIXTRAL_ATOL)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.tie_word_embeddings is tie


@pytest.mark.parametrize(
    "router, options, reason",
    [
        ("expert_choice", {}, "router 'expert_choice' has no Mixtral counterpart"),
        ("ec_threshold", {}, "router 'ec_threshold' has no Mixtral counterpart"),
        ("topk", {"normalize": False}, "topk with normalize=False"),
        ("topk", {"balance_rate": 0.1}, "a non-zero balance bias"),
    ],
)
def test_a_preset_with_no_transformers_counterpart_exports_as_our_class(tmp_path, router, options, reason):
    """Expert choice and ec_threshold (its thresholds trained), and top-k options Mixtral lacks:
    this package's class, loaded exactly, generating (expert choice included) as the full forward."""
    ours = tiny_preset(router, router_options=options)
    with pytest.raises(ValueError, match=reason):
        export_pretrained(ours, tmp_path, architecture="native")
    assert export_pretrained(ours, tmp_path) == "MoETransformerForCausalLM"
    assert (tmp_path / "causal_moe_hf.py").exists()
    check_loaded(tmp_path, ours, "MoETransformerForCausalLM", 0.0)


def test_shared_experts_and_dense_blocks_are_no_mixtral(tmp_path):
    ours = tiny_preset(shared_experts=1, shared_expert_gate=True, n_layers=2, moe_every=2)
    with pytest.raises(ValueError, match="dense blocks"):
        export_pretrained(ours, tmp_path, architecture="native")
    assert export_pretrained(ours, tmp_path) == "MoETransformerForCausalLM"
    check_loaded(tmp_path, ours, "MoETransformerForCausalLM", 0.0)


@pytest.mark.parametrize(
    "spec, router, architecture",
    [
        ("olmoe-tiny", "topk", "OlmoeForCausalLM"),
        ("deepseek-v3-tiny", "topk", "DeepseekV3ForCausalLM"),
        ("qwen2-moe-tiny", "ec_threshold", "SwappedMoEForCausalLM"),
        ("olmoe-tiny", "expert_choice", "SwappedMoEForCausalLM"),
    ],
)
def test_a_swapped_model_exports_as_its_family_or_our_class(tmp_path, spec, router, architecture):
    """A swapped model whose routers route as its family's gates is its own architecture again
    (DeepSeek-V3's trained correction bias included); with another router, our class, which
    rebuilds it from its transformers config and the router."""
    ours = trained(build_hf_model(spec, router, {"balance_rate": 0.1} if "deepseek" in spec else {}, V))
    assert export_pretrained(ours, tmp_path) == architecture
    check_loaded(tmp_path, ours, architecture, MIXTRAL_ATOL)  # a transformers model inside either way


def test_a_swapped_topk_with_other_options_is_not_its_family(tmp_path):
    ours = build_hf_model("olmoe-tiny", "topk", {"top_k": 1}, V).eval()
    with pytest.raises(ValueError, match="MoE block 0: topk with top_k other than its family's"):
        export_pretrained(ours, tmp_path, architecture="native")
    assert export_pretrained(ours, tmp_path, architecture="custom") == "SwappedMoEForCausalLM"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.router_options == {"top_k": 1}
    assert export_pretrained(loaded, tmp_path / "again") == "SwappedMoEForCausalLM"  # a loaded one re-exports


def test_bad_input_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="architecture must be one of 'auto', 'native', 'custom'"):
        export_pretrained(tiny_preset(), tmp_path, architecture="mixtral")
    plain = AutoModelForCausalLM.from_config(build_hf_model("olmoe-tiny", "topk", {}, V).hf.config)
    with pytest.raises(ValueError, match="has no swapped MoE block: save it with its own save_pretrained"):
        export_pretrained(plain, tmp_path)
    sharded = tiny_preset()
    sharded.blocks[0].ffn.expert_parallel = object()  # what an expert-parallel rank holds: some experts
    with pytest.raises(ValueError, match="experts are sharded over processes: export the consolidated model"):
        export_pretrained(sharded, tmp_path)
    loaded = MoETransformerForCausalLM.from_pretrained(export_folder(tmp_path / "ec", "expert_choice"))
    with pytest.raises(ValueError, match="padded batches are not supported"):
        loaded(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))


def export_folder(folder, router: str):
    export_pretrained(tiny_preset(router), folder)
    return folder


def test_the_loaded_class_takes_labels_as_transformers_does(tmp_path):
    loaded = MoETransformerForCausalLM.from_pretrained(export_folder(tmp_path, "ec_threshold"))
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        out = loaded(input_ids=ids, labels=ids)
        want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want)


@pytest.mark.parametrize(
    "run, architecture",
    [
        (dict(SMALL_RUN, router="expert_choice"), "MoETransformerForCausalLM"),
        (dict(HF_RUN, hf_model="olmoe-tiny", router="topk"), "OlmoeForCausalLM"),
        (dict(HF_RUN, hf_model="olmoe-tiny", router="ec_threshold"), "SwappedMoEForCausalLM"),
    ],
    ids=["preset", "hf-model-family", "hf-model-ec-threshold"],
)
def test_export_hf_writes_the_trained_model_beside_model_pt(tmp_path, run, architecture):
    """``--export-hf``: ``checkpoint_dir/hf/`` next to ``model.pt``, holding the run's final model."""
    corpus = load_corpus("stdlib", 0.1, 100_000)
    cfg = TrainConfig.flat(**run, steps=2, wandb_mode="disabled", checkpoint_dir=str(tmp_path), export_hf=True)
    model = train(cfg, corpus).model.eval()
    assert (tmp_path / "model.pt").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == architecture
    ids = torch.randint(0, corpus.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_export_hf_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="export_hf need checkpoint_dir"):
        TrainConfig.flat(export_hf=True)


@pytest.mark.slow
def test_a_custom_folder_loads_with_trust_remote_code_alone(tmp_path):
    """A fresh process that imports only transformers: ``trust_remote_code=True`` finds our
    classes through the folder's ``auto_map`` (the installed package must be importable);
    without it transformers refuses, naming the flag. Greedy tokens equal ours."""
    ours = tiny_preset("expert_choice")
    export_pretrained(ours, tmp_path)
    prompt = torch.randint(0, V, (1, 6))
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "except ValueError as e:\n"
        "    print('refused:', 'trust_remote_code=True' in str(e))\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)\n"
        f"print(m.generate(torch.tensor({prompt.tolist()}), max_new_tokens=8, do_sample=False)[0].tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=SUBPROCESS_ENV, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "refused: True" in out.stdout and lines[-1] == str(greedy(ours, prompt, 8)[0].tolist()), out.stdout
