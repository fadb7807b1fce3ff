"""Exact mode (moe.exact_mode): for every causal, decode-consistent router, the teacher-forced
forward, KV-cache decoding one token at a time, a sequence alone and inside a batch of others, and
a prompt prefilled whole or in chunks give the same logits and routing bit for bit (torch.equal),
in fp32 and bf16 on CPU, with the torch and the grouped_mm backends. Outside the mode these differ
in the last bits (fp32: GEMMs of 1-3 rows take another kernel; bf16: attention with a mask)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from helpers import DEEPSEEK_V3_STYLE, small_lm

import moe
from moe.exact import ExactnessWarning, blocked_matmul, exact_attention, stable_topk
from moe.model import MoETransformer

ROUTERS = {
    "topk": ("topk", {"top_k": 2}),
    "topk_sigmoid_lossfree": ("topk", {"top_k": 2, "gate": "sigmoid", "balance_rate": 0.1}),
    "topk_null": ("topk", {"top_k": 2, "null_experts": 2}),
    "topk_deepseek_v3": ("topk", DEEPSEEK_V3_STYLE),
    "capacity_prefix": ("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 1.0}),
    "expert_threshold": ("ec_threshold", {"statistic": "population", "score": "sigmoid", "aux_loss_coef": 0.0}),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 1.0}),
    "quantile": ("quantile", {"top_k": 2}),
    "remoe": ("remoe", {"top_k": 2}),
    "top_p": ("top_p", {"target_experts": 2.0}),
}
"""Every router that is causal and decode-consistent in eval mode, in its main configurations."""
V, B, T = 64, 3, 16


def model_for(router: str, options: dict, dtype: torch.dtype, backend: str = "torch") -> MoETransformer:
    """helpers.small_lm's model, 32 wide with 8 experts and 16 positions: at that size bf16's
    attention already differs between the paths outside exact mode (at T=10 it did not)."""
    base = small_lm(router, options, vocab_size=V, max_seq_len=16).cfg
    cfg = replace(base, d_model=32, moe_d_ff=32, num_experts=8, backend=backend)
    return MoETransformer(cfg, init_seed=3).to(dtype).eval()


def cached(model, idx_BT, chunk: int):
    """(logits, record) of idx_BT fed through the KV cache ``chunk`` tokens at a time."""
    cache = model.init_cache(idx_BT.shape[0], idx_BT.shape[1])
    with moe.record_routing(model) as record:
        logits = [model(idx_BT[:, s : s + chunk], cache=cache).logits for s in range(0, idx_BT.shape[1], chunk)]
    return torch.cat(logits, 1), record.experts


def full(model, idx_BT):
    with moe.record_routing(model) as record:
        logits = model(idx_BT).logits
    return logits, record.experts


def padded(experts_BSLK: torch.Tensor, k: int) -> torch.Tensor:
    """A record's experts with K slots (a record's K is the most experts one token got in it)."""
    return torch.nn.functional.pad(experts_BSLK, (0, k - experts_BSLK.shape[-1]), value=-1)


def assert_same(a, b, what: str) -> None:
    k = max(a[1].shape[-1], b[1].shape[-1])
    for name, x, y in (("logits", a[0], b[0]), ("routing", padded(a[1], k), padded(b[1], k))):
        assert x.shape == y.shape and torch.equal(x, y), (
            f"{what}: {name} differ, max {(x.double() - y.double()).abs().max().item():.3g}"
        )


def check_gate(model) -> None:
    idx_BT = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), moe.exact_mode():
        teacher = full(model, idx_BT)
        assert_same(cached(model, idx_BT, 1), teacher, "KV-cache decoding one token at a time vs teacher-forced")
        alone = full(model, idx_BT[1:2])
        assert_same(alone, (teacher[0][1:2], teacher[1][1:2]), "sequence alone vs inside the batch")
        whole = cached(model, idx_BT, T)
        assert_same(cached(model, idx_BT, 4), whole, "prefill in chunks of 4 vs whole")
        assert_same(whole, teacher, "cached whole prefill vs teacher-forced")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ROUTERS)
def test_exact_mode_gives_every_path_the_same_bits(case, dtype):
    router, options = ROUTERS[case]
    check_gate(model_for(router, options, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["topk", "ec_threshold", "capacity_prefix"])
def test_exact_mode_gives_every_path_the_same_bits_on_grouped_mm(case, dtype):
    router, options = ROUTERS[case]
    check_gate(model_for(router, options, dtype, backend="grouped_mm"))


def test_exact_mode_computes_the_same_function():
    # the blocked forms reorder nothing within a row's reduction beyond a GEMM's own rounding
    model = model_for("topk", {"top_k": 2}, torch.float64)
    idx_BT = torch.randint(0, V, (B, T))
    with torch.no_grad():
        want = model(idx_BT).logits
        with moe.exact_mode():
            got = model(idx_BT).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def test_blocked_matmul_and_attention_match_float64_references():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 37, 24, generator=g), torch.randn(24, 40, generator=g)
    want = a.double() @ b.double()
    assert (blocked_matmul(a, b).double() - want).abs().max() < 1e-4  # fp32 sums of 24 products of N(0,1)
    bb = torch.randn(2, 24, 40, generator=g)
    assert (blocked_matmul(a, bb).double() - a.double() @ bb.double()).abs().max() < 1e-4
    q, k, v = (torch.randn(2, 3, 70, 8, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert (exact_attention(q, k, v, is_causal=True).double() - ref).abs().max() < 1e-5
    mask = torch.rand(70, 70, generator=g) < 0.7
    mask[:, 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (exact_attention(q, k, v, attn_mask=mask).double() - ref).abs().max() < 1e-5


def test_ties_go_to_the_lower_expert_index():
    scores_NE = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert stable_topk(scores_NE, 2).indices.tolist() == [[1, 2], [0, 1]]
    with moe.exact_mode():
        assert torch.topk(scores_NE, 3).indices.tolist() == [[1, 2, 4], [0, 1, 2]]
        assert scores_NE.topk(1, largest=False).indices.tolist() == [[3], [0]]


@pytest.mark.parametrize(
    ("router", "options"),
    [
        ("expert_choice", {"capacity_factor": 1.0}),
        ("capacity", {"top_k": 2, "priority": "score"}),
        ("capacity", {"top_k": 2, "group": "batch"}),
        ("seq_topk", {"top_k": 2}),
    ],
)
def test_a_router_that_cannot_be_exact_says_so(router, options):
    model = model_for(router, options, torch.float32)
    with torch.no_grad(), moe.exact_mode(), pytest.warns(ExactnessWarning, match=f"router '{router}' cannot be exact"):
        model(torch.randint(0, V, (2, 6)))


def test_an_exact_router_says_nothing_and_the_mode_ends_with_its_block():
    model = model_for("topk", {"top_k": 2}, torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with moe.exact_mode():
            model(torch.randint(0, V, (2, 6)))
    assert not moe.exact.exact_active()
    with torch.no_grad(), pytest.warns(ExactnessWarning, match="backend 'triton' cannot be exact"):
        layer = moe.MoELayer(16, 16, 4, backend="triton") if moe.experts.triton_installed() else None
        if layer is None:
            pytest.skip("triton is not installed")
        with moe.exact_mode():
            layer(torch.randn(1, 2, 16))
