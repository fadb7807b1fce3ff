"""Latent experts (LatentMoE, ``MoELayer(latent_dim=L)``): against a per-assignment reference in
float64 (outputs and every gradient to 1e-12: float64 rounding of these few-term sums is ~1e-16,
a misplaced projection is off by > 1e-2), audited clean, decoded through the KV cache like the
full forward, replayed bit for bit, and counted in active parameters and the study's
equal-compute check."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, assert_cache_decoding_is_the_full_forward, assert_replay_is_the_recorded_forward, small_lm

import moe
from moe.audit import assert_causal
from moe.layer import active_ffn_width
from moe.model import MoETransformer
from moe.parallel import ExpertParallel, load_full_state_dict
from moe.parallel.launch import ok_values, run_local

sys.path.insert(0, str(ROOT / "experiments"))
import router_study as study  # noqa: E402

D, L, FF, E = 16, 6, 12, 4


def reference(layer: moe.MoELayer, x_BTD: torch.Tensor) -> torch.Tensor:
    """The router on the full x; per kept assignment, the expert on W_down^lat x; the sum of a
    token's rows, then W_up^lat: one token and one assignment at a time."""
    b, t, d = x_BTD.shape
    routing = layer.router(x_BTD)
    x_ND, ex = x_BTD.reshape(b * t, d), layer.experts
    down, up = layer.latent.down.weight, layer.latent.up.weight
    rows = [torch.zeros(L, dtype=x_BTD.dtype) for _ in range(b * t)]
    for a in range(routing.num_assignments):
        n, e, w = int(routing.token[a]), int(routing.expert[a]), routing.weight[a]
        z = down @ x_ND[n]
        rows[n] = rows[n] + w * ((F.silu(z @ ex.w_gate[e]) * (z @ ex.w_up[e])) @ ex.w_down[e])
    return torch.stack([up @ r for r in rows]).view(b, t, d)


@pytest.mark.parametrize("router,options", [("topk", {"top_k": 2}), ("ec_threshold", {"capacity_factor": 1.0})])
def test_latent_layer_equals_the_per_assignment_reference_with_every_gradient(router, options):
    torch.manual_seed(0)
    layer = moe.MoELayer(D, FF, E, router=router, latent_dim=L, **options).double().train()
    assert tuple(layer.experts.w_gate.shape) == (E, L, FF) and tuple(layer.router.gate.weight.shape) == (E, D)
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    params = [x, *layer.parameters()]
    y = layer(x)
    y_ref = reference(layer, x)
    g = torch.randn_like(y)
    grads, grads_ref = torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g)
    assert (y - y_ref).abs().max() < 1e-12, f"max {(y - y_ref).abs().max():.3g}"
    for p, a, r in zip(["x", *dict(layer.named_parameters())], grads, grads_ref):
        assert (a - r).abs().max() < 1e-12, f"{p}: max {(a - r).abs().max():.3g}, mean {(a - r).abs().mean():.3g}"
    assert layer.latent.down.weight.grad is None  # autograd.grad touched no .grad
    assert all(gr.abs().sum() > 0 for gr in grads[-2:])  # both projections learn


def test_latent_layer_and_model_audit_clean_and_decode_like_the_full_forward():
    torch.manual_seed(0)
    layer = moe.MoELayer(D, FF, E, router="topk", latent_dim=L, top_k=2)
    assert_causal(layer, torch.randn(2, 8, D), batch_invariant=True, decode_consistent=True, trials=1)
    model = small_lm("topk", {"top_k": 2}, moe_latent_dim=L).eval()
    idx = torch.randint(0, 32, (2, 10))
    assert_causal(model, idx, batch_invariant=True, decode_consistent=True, trials=1, agreement=False)
    assert_cache_decoding_is_the_full_forward(model, idx)


def test_latent_model_replays_its_record_bit_for_bit():
    model = small_lm("topk", {"top_k": 2}, torch.float64, moe_latent_dim=L).train()
    idx, targets = torch.randint(0, 32, (3, 9)), torch.randint(0, 32, (3, 9))
    assert_replay_is_the_recorded_forward(model, idx, targets)


def test_active_parameters_count_latent_experts_at_their_width_and_both_projections():
    plain = small_lm("topk", {"top_k": 2})
    latent = small_lm("topk", {"top_k": 2}, moe_latent_dim=L)
    layers = 2
    # small_lm's experts are 16 wide: a latent one holds 3 * L * 16 weights instead of 3 * D * 16, and
    # each layer adds 2 * D * L of projections, which every token uses
    expected_total = plain.num_parameters() - layers * E * 3 * (D - L) * 16 + layers * 2 * D * L
    assert latent.num_parameters() == expected_total
    expected_active = plain.num_parameters(active=True) - layers * 2 * 3 * (D - L) * 16 + layers * 2 * D * L
    assert latent.num_parameters(active=True) == expected_active


def test_equal_compute_counts_the_latent_experts_and_projections(monkeypatch):
    router = moe.build_router("topk", d_model=128, num_experts=8, top_k=2)
    # 2 experts of 3 * 96 * 256 weights + 2 * 128 * 96 of projections = a dense SwiGLU of 3 * 128 * 448
    assert active_ffn_width(router, 256, latent_dim=96) == 448
    assert active_ffn_width(router, 256, shared_experts=1, latent_dim=96) == 448 + 256
    layer = moe.MoELayer(128, 256, 8, router=router, latent_dim=96)
    assert layer.active_ffn_width() == 448
    monkeypatch.setitem(study.ROUTERS, "latent96", ("topk", {"top_k": 2}, {"model": {"moe_latent_dim": 96}}))
    with pytest.raises(study.StudyError, match="routed in latent width 96: dense width 448"):
        study.check_compute(["latent96"], ["baby"], allow_unequal=False)  # baby's dense width is 512
    monkeypatch.setitem(study.SIZES, "baby448", {**study.SIZES["baby"], "d_ff": 448})
    study.check_compute(["latent96"], ["baby448"], allow_unequal=False)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: moe.MoELayer(D, FF, E, latent_dim=D), "latent_dim=16 must be smaller than d_model=16"),
        (lambda: moe.MoELayer(D, FF, E, latent_dim=0), "latent_dim must be"),
        (lambda: small_lm("topk", {}, moe_latent_dim=32), r"moe_latent_dim must be an integer in \[1, d_model=16\)"),
        (
            lambda: moe.MoELayer(D, FF, E, latent_dim=L, experts=moe.experts.SwiGLUExperts(E, D, FF)),
            "layer needs 4, 6, 12",
        ),
    ],
)
def test_bad_latent_options(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def _expert_parallel_worker(rank: int, world: int, full_state: dict, cfg, idx, targets) -> dict:
    ep = ExpertParallel(torch.distributed.group.WORLD)
    sharded = MoETransformer(cfg, expert_parallel=ep, init_seed=1).double()
    load_full_state_dict(sharded, full_state, ep)
    rows = slice(rank * 2, rank * 2 + 2)
    out = sharded(idx[rows], targets[rows])
    out.loss.backward()
    return {"logits": out.logits.detach(), "down_grad": [b.ffn.latent.down.weight.grad for b in sharded.blocks]}


@pytest.mark.slow
def test_latent_experts_under_expert_parallelism_equal_one_process():
    """2 gloo processes (about 25 s on a loaded machine), 2 experts each, exchanging L-wide rows: the logits of one process (float64,
    1e-10: only the summation order of the exchange differs), and the replicated down-projection's
    gradient (each rank's mean loss over its half: the two halves average to the whole)."""
    model = small_lm("topk", {"top_k": 2}, torch.float64, moe_latent_dim=L)
    idx, targets = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    out = model(idx, targets)
    out.loss.backward()
    per_rank = ok_values(run_local(_expert_parallel_worker, 2, model.state_dict(), model.cfg, idx, targets))
    logits = torch.cat([r["logits"] for r in per_rank])
    assert (logits - out.logits).abs().max() < 1e-10, (logits - out.logits).abs().max()
    for layer, block in enumerate(model.blocks):
        grad = per_rank[0]["down_grad"][layer] / 2 + per_rank[1]["down_grad"][layer] / 2
        assert (grad - block.ffn.latent.down.weight.grad).abs().max() < 1e-10, f"layer {layer}"
