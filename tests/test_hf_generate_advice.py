"""A swapped transformers model that cannot decode from the cache says what transformers'
``generate`` accepts instead, and one that generates outside ``decoding()`` while it would
misroute says so, once (tiny random OLMoE, no downloads)."""

import warnings

import pytest
import torch
from extras import need

need("transformers", "hf")

from moe.integrations.hf import decoding, load_hf_model, swap_moe_blocks  # noqa: E402

V = 64
PREFIX_CAPACITY = {"capacity_scope": "prefix", "capacity_factor": 0.5}


def swapped(router: str, **options):
    return swap_moe_blocks(load_hf_model("olmoe-tiny", vocab_size=V), router, **options).eval()


def full_forward_greedy(model, prompt, n: int) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq, use_cache=False).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


def test_decoding_refuses_expert_choice_with_advice_that_generate_accepts():
    model = swapped("expert_choice")
    with pytest.raises(ValueError) as refusal:
        with decoding(model, batch_size=2):
            pass
    advice = str(refusal.value)
    assert "recompute" not in advice and "outside decoding() with use_cache=False" in advice, advice
    prompt = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match="recompute"):  # what the advice said before: generate rejects it
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0, recompute=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # following the advice warns of nothing
        new = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(new, full_forward_greedy(model, prompt, 8))


def generate_twice(model, **options) -> list[str]:
    prompt = torch.randint(0, V, (2, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, **options)
    return [str(w.message) for w in caught if "decoding()" in str(w.message)]


@pytest.mark.parametrize(
    "router, options, advice",
    [("expert_choice", {}, "use_cache=False"), ("capacity", PREFIX_CAPACITY, "inside `with decoding(model")],
    ids=["expert_choice", "capacity-prefix"],
)
def test_generating_outside_decoding_with_a_misrouting_router_warns_once(router, options, advice):
    messages = generate_twice(swapped(router, **options))
    assert len(messages) == 1 and messages[0].startswith("generating outside decoding(): MoE block 0:"), messages
    assert advice in messages[0]


def test_no_warning_where_generate_routes_as_the_full_forward():
    assert generate_twice(swapped("ec_threshold")) == []  # routes every token alone
    assert generate_twice(swapped("topk")) == []
    assert generate_twice(swapped("expert_choice"), use_cache=False) == []  # the whole sequence every step
    model = swapped("capacity", **PREFIX_CAPACITY)
    with decoding(model, batch_size=2):
        assert generate_twice(model) == []
