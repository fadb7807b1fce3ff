"""Which presets are a Mixtral (:func:`moe.integrations.hf.mixtral.mixtral_mismatch`), each
condition on its own, and the swapped blocks' own checks and options.

The reference for "is a Mixtral" is transformers' Mixtral itself: where the check says yes,
``to_mixtral`` computes our logits to fp32 rounding; where it names a reason, the Mixtral a
conversion would give computes other logits (so the refusal is not spurious).
"""

import pytest
import torch
from extras import need
from helpers import assignments

need("transformers", "hf")

from transformers import AutoModelForCausalLM  # noqa: E402

from moe.integrations.hf import FAMILIES, build_hf_model, swap_moe_blocks, swapped_routings, tiny_config  # noqa: E402
from moe.integrations.hf.blocks import family_router_options  # noqa: E402
from moe.integrations.hf.mixtral import mixtral_mismatch, to_mixtral  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402

V = 64
MIXTRAL_ATOL = 1e-5


def tiny(router_options: dict | None = None, **fields) -> MoETransformer:
    torch.manual_seed(0)
    cfg = preset(
        "tiny",
        router="topk",
        vocab_size=V,
        d_model=32,
        moe_d_ff=32,
        max_seq_len=32,
        router_options=router_options or {},
        **fields,
    )
    model = MoETransformer(cfg).eval()
    with torch.no_grad():  # decisive gates, so that routing differences show in the logits
        for router in model.routers():
            router.gate.weight.normal_(0, 0.5)
    return model


def mixtral_gap(model: MoETransformer) -> float:
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (to_mixtral(model)(input_ids=ids).logits - model(ids).logits).abs().max().item()


def test_top_k_softmax_over_the_k_is_a_mixtral():
    """pre_softmax=False (softmax of the K kept logits) gives Mixtral's renormalised weights
    without normalize: a Mixtral, to fp32 rounding."""
    model = tiny({"pre_softmax": False, "normalize": False})
    assert mixtral_mismatch(model) is None
    assert mixtral_gap(model) <= MIXTRAL_ATOL


@pytest.mark.parametrize(
    "options, fields, reason",
    [
        ({"route_scale": 2.0}, {}, "route_scale=2.0"),
        ({"num_expert_groups": 2, "num_limited_groups": 1}, {}, "group-limited routing"),
        ({"router_dtype": "bf16"}, {}, "router_dtype='bf16'"),
        ({}, {"shared_experts": 1}, "shared experts"),
    ],
)
def test_each_feature_mixtral_lacks_is_named(options, fields, reason):
    model = tiny(options, **fields)
    assert reason in (mixtral_mismatch(model) or "")
    assert mixtral_gap(model) > 1e-3  # Mixtral's layers would compute something else


def test_expert_choice_in_a_swapped_family_spends_the_familys_k_experts_per_token():
    """capacity_factor = K: each expert keeps K/E of the tokens, K = 2 assignments per token on average."""
    assert family_router_options("expert_choice", 2, True) == {"capacity_factor": 2.0}
    model = build_hf_model("olmoe-tiny", "expert_choice", {}, V).eval()
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        model(ids)
    for routing in swapped_routings(model.hf):
        assert len(assignments(routing)) == 2 * ids.numel()


def test_experts_of_another_width_than_the_gate_are_refused():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral-tiny", V), dtype=torch.float32)
    block = next(m for m in model.modules() if type(m).__name__ in FAMILIES)
    e, two_f, d = block.experts.gate_up_proj.shape
    block.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(e, two_f, d + 1))
    with pytest.raises(ValueError, match=rf"gate is \[{e}, {d}\] but experts hold {e} x {d + 1}"):
        swap_moe_blocks(model, "topk")
