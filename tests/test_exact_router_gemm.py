"""The router GEMM without casting the activations (router_dtype="bf16_fp32", issue 56 item 2):
bf16 inputs and weight, fp32 accumulation and logits, against the fp64 GEMM of the same bf16
values; and the margin view of the agreement figures."""

from __future__ import annotations

import pytest
import torch

import moe


def test_bf16_in_fp32_out_is_the_fp64_gemm_of_the_bf16_values_to_fp32_rounding():
    router = moe.build_router("topk", d_model=64, num_experts=8, router_dtype="bf16_fp32")
    x_ND = torch.randn(40, 64)
    logits = router.score_logits(x_ND)
    assert logits.dtype == torch.float32
    bf16_x, bf16_w = x_ND.bfloat16().double(), router.gate.weight.bfloat16().double()
    reference = bf16_x @ bf16_w.t()  # products of bf16 values are exact in fp32; only the sums round
    assert (logits.double() - reference).abs().max() < 1e-5
    rounded_out = x_ND.bfloat16() @ router.gate.weight.bfloat16().t()  # what router_dtype="input" gives
    assert (rounded_out.double() - reference).abs().max() > 10 * (logits.double() - reference).abs().max()


def test_bf16_fp32_equals_the_cast_for_a_bf16_model_on_cpu():
    router = moe.build_router("topk", d_model=32, num_experts=4, router_dtype="fp32").bfloat16()
    x_ND = torch.randn(24, 32, dtype=torch.bfloat16)
    cast = router.score_logits(x_ND)
    router.router_dtype = "bf16_fp32"
    assert torch.equal(router.score_logits(x_ND), cast)


def test_an_unknown_router_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="router_dtype must be one of fp32, fp64, bf16, input, bf16_fp32"):
        moe.build_router("topk", d_model=8, num_experts=4, router_dtype="fp16_fp32")


def test_the_margin_view_bins_flips_by_the_gap_between_the_kth_and_next_score():
    from moe.agreement import margin_view, routing_agreement

    a = moe.RoutingRecord(1, torch.tensor([0, 1, 2, 3]).view(1, 4, 1, 1))
    b = moe.RoutingRecord(1, torch.tensor([0, 2, 2, 1]).view(1, 4, 1, 1))  # tokens 1 and 3 flipped
    gaps_NL = torch.tensor([[5e-5], [5e-5], [0.5], [2e-3]], dtype=torch.float64)
    view = margin_view(routing_agreement(a, b), gaps_NL)
    assert view["pairs"] == [[2, 0, 1, 0, 1]]
    assert view["flip_share"] == [[0.5, 0.0, 1.0, 0.0, 0.0]]


def test_agreement_figures_carry_the_margin_view_per_layer():
    from helpers import small_lm

    from moe.agreement import agreement_figures

    model = small_lm("topk", {"top_k": 2})
    idx_BT = torch.randint(0, 32, (2, 8))
    figures = agreement_figures(model, idx_BT, paths=["bf16_model", "decode"])
    for figure in figures.values():
        assert [sum(p) for p in figure.margin["pairs"]] == [16, 16]  # every (token, layer) pair in one bin
        flips = sum(c * s for p, f in zip(figure.margin["pairs"], figure.margin["flip_share"]) for c, s in zip(p, f))
        assert round(flips) == round((1 - figure.share) * figure.pairs)
    thresholds = agreement_figures(small_lm("ec_threshold", {}), idx_BT, paths=["decode"])
    assert thresholds["decode"].margin is None  # no top_k: no k-th score


@pytest.mark.gpu
def test_bf16_fp32_on_cuda_is_the_out_dtype_gemm_of_the_bf16_values():
    """The CUDA branch (torch.mm with out_dtype=float32) against the fp64 GEMM of the same bf16
    values: fp32 rounding of the sums, well inside what bf16 logits lose, and the same top-2."""
    router = moe.build_router("topk", d_model=512, num_experts=64, router_dtype="bf16_fp32").cuda().bfloat16()
    x_ND = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    logits = router.score_logits(x_ND)
    assert logits.dtype == torch.float32 and logits.is_cuda
    reference = x_ND.double() @ router.gate.weight.double().t()
    err = (logits.double() - reference).abs().max().item()
    bf16_err = ((x_ND @ router.gate.weight.t()).double() - reference).abs().max().item()
    assert err < 1e-4 * reference.abs().max().item() and err < bf16_err / 10
    same = (torch.topk(logits, 2).indices.sort(-1).values == torch.topk(reference, 2).indices.sort(-1).values).all(-1)
    assert same.double().mean().item() > 0.999
