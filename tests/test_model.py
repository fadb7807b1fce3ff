"""The small MoE language model: config validation, shapes, causality, training."""

import math

import pytest
import torch

import moe
from moe.model import PRESETS, ModelConfig, MoETransformer, preset


@pytest.mark.parametrize("router", moe.list_routers())
def test_forward_shapes_and_aux(router):
    model = MoETransformer(preset("tiny", router=router, n_layers=3, moe_every=1))
    idx = torch.randint(0, 256, (2, 16))
    out = model(idx, idx)
    assert out.logits.shape == (2, 16, 256)
    assert len(out.routings) == 3
    assert torch.allclose(out.aux_loss, sum(r.aux_loss for r in out.routings))
    assert out.loss.item() == pytest.approx(math.log(256), abs=0.5)


def test_moe_every_and_dense_model():
    assert (
        len(MoETransformer(preset("tiny", n_layers=4, moe_every=2))(torch.zeros(1, 4, dtype=torch.long)).routings) == 2
    )
    dense = MoETransformer(preset("tiny", moe_every=0))
    out = dense(torch.zeros(1, 4, dtype=torch.long))
    assert out.routings == [] and out.aux_loss.item() == 0.0


def test_no_bias_terms_anywhere():
    model = MoETransformer(preset("tiny"))
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


def test_causal_router_model_is_causal_and_expert_choice_is_not():
    idx = torch.randint(0, 256, (2, 24))
    idx2 = idx.clone()
    idx2[:, 12:] = torch.randint(0, 256, (2, 12))
    for router, leaks in (("topk", False), ("expert_choice", True)):
        torch.manual_seed(0)
        model = MoETransformer(preset("tiny", router=router, router_options={"capacity_factor": 0.5} if leaks else {}))
        a, b = model(idx).logits[:, :12], model(idx2).logits[:, :12]
        assert (not torch.equal(a, b)) == leaks, router


def test_tiny_preset_learns_a_repeating_pattern():
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny", router="capacity", router_options={"capacity_factor": 1.0}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(0, 33).repeat(8, 1) % 7
    losses = []
    for _ in range(60):
        out = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        (out.loss + out.aux_loss).backward()
        opt.step()
        moe.update_routers(model)
        losses.append(out.loss.item())
    assert losses[-1] < 0.25 * losses[0], losses[::10]


def test_presets_are_valid_and_overridable():
    assert set(PRESETS) >= {"tiny", "small", "gpu100m"}
    cfg = preset("tiny", router="expert_choice", num_experts=8)
    assert cfg.router == "expert_choice" and cfg.num_experts == 8 and PRESETS["tiny"].num_experts == 4
    with torch.device("meta"):  # shapes only: counting 100M parameters needs no memory
        big = MoETransformer(PRESETS["gpu100m"])
    assert 95e6 < big.num_parameters() < 105e6
    assert big.num_parameters(active=True) < 0.4 * big.num_parameters()


def test_preset_router_options_carry_over_only_to_the_presets_router():
    assert preset("gpu100m").router_options == {"top_k": 2}
    assert preset("gpu100m", router_options={"gate": "sigmoid"}).router_options == {"top_k": 2, "gate": "sigmoid"}
    assert preset("gpu100m", router="capacity").router_options == {}
    cfg = preset("gpu100m", router="expert_choice", router_options={"capacity_factor": 2.0})
    assert cfg.router_options == {"capacity_factor": 2.0}
    with torch.device("meta"):  # used to fail: unexpected keyword argument 'top_k'
        model = MoETransformer(preset("gpu100m", router="expert_choice"))
    assert model.routers()[0].capacity_factor == 1.0
    assert PRESETS["gpu100m"].router_options == {"top_k": 2}  # the preset itself is untouched


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(d_model=0), "d_model must be a positive integer"),
        (dict(d_model=60, n_heads=8), "n_heads=8 must divide d_model=60"),
        (dict(d_model=12, n_heads=4), "must be even for rotary"),
        (dict(moe_every=-1), "moe_every must be an integer >= 0"),
        (dict(num_experts=2.5), "num_experts must be a positive integer"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_bad_preset_and_inputs():
    with pytest.raises(ValueError, match="unknown preset 'huge'; known presets: tiny"):
        preset("huge")
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['layers'\]"):
        preset("tiny", layers=3)
    with pytest.raises(ValueError, match="unknown router"):
        MoETransformer(preset("tiny", router="nope"))
    model = MoETransformer(preset("tiny", max_seq_len=8))
    with pytest.raises(ValueError, match="expected int64 token ids"):
        model(torch.randn(2, 4))
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_initial_weights_have_the_documented_spread():
    """Norm gains start at 1, the embedding N(0, 0.02), every other matrix N(0, 1/fan_in) (fan_in
    the input width), and the three projections back into the residual stream (attention out,
    dense and expert down) a further 1/sqrt(2 * n_layers): tiny preset, D 64, dense width 128,
    expert width 128, 2 layers. Sample spreads of these fixed draws within 5% (15% for the
    256-element router gate)."""
    model = MoETransformer(preset("tiny", n_layers=2, moe_every=2), init_seed=3)
    residual = 1 / math.sqrt(2 * 2)
    want = {
        "embed.weight": 0.02,
        "attn.qkv.weight": 64**-0.5,
        "attn.proj.weight": 64**-0.5 * residual,
        "ffn.w_gate.weight": 64**-0.5,
        "ffn.w_up.weight": 64**-0.5,
        "ffn.w_down.weight": 128**-0.5 * residual,
        "ffn.router.gate.weight": 64**-0.5,
        "ffn.experts.w_gate": 64**-0.5,
        "ffn.experts.w_up": 64**-0.5,
        "ffn.experts.w_down": 128**-0.5 * residual,
    }
    seen = set()
    for name, p in model.named_parameters():
        p = p.detach().double()
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        kind = next(k for k in want if name == k or name.endswith("." + k))
        seen.add(kind)
        assert abs(float(p.mean())) < 4 * want[kind] / math.sqrt(p.numel()), name
        assert float(p.std()) == pytest.approx(want[kind], rel=0.15 if p.numel() < 1000 else 0.05), name
    assert seen == set(want)
