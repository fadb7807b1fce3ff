"""The routers whose compute varies per token (ReMoE, top-p, null experts) and Expert Threshold's
population statistic, each against a per-token Python reference, their controllers, and
their training on two gloo processes (FSDP2 and expert parallelism) against one process.

Every reference below is written from the papers' definitions, token by token, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY_RUN, identity_router

import moe
from moe.parallel.launch import ok_values, run_local
from moe.routers.ec_threshold import population_cutoff
from moe.training import TrainConfig, train


def pairs(routing: moe.Routing) -> dict[tuple[int, int], float]:
    return {(int(t), int(e)): float(w) for t, e, w in zip(routing.token, routing.expert, routing.weight.detach())}


# -- ReMoE ------------------------------------------------------------------------------------
def test_remoe_gates_are_the_positive_logits_and_the_l1_penalty_is_load_weighted():
    r = identity_router("remoe", 4, z_loss_coef=0.0, l1_init=0.5)
    x = torch.tensor([[[1.0, -2.0, 0.5, 0.0], [-1.0, -1.0, -1.0, 3.0], [-0.5, -0.1, -0.2, -0.3]]], dtype=torch.float64)
    out = r(x)
    expected = {(0, 0): 1.0, (0, 2): 0.5, (1, 3): 3.0}  # relu > 0; token 2 gets no expert
    assert pairs(out) == pytest.approx(expected)
    assert float(out.stats["dropped_fraction"]) == pytest.approx(1 / 3)
    active = [1, 0, 1, 1]  # assignments per expert; f_e = E * active_e / 3
    mean_gate = [1.0 / 3, 0.0, 0.5 / 3, 3.0 / 3]
    ref = 0.5 * sum(4 * a / 3 * g for a, g in zip(active, mean_gate))
    assert out.aux_loss.item() == pytest.approx(ref, rel=1e-12)


def test_remoe_controller_holds_the_active_experts_at_top_k():
    r = identity_router("remoe", 4, top_k=1, l1_init=1e-3, l1_rate=2.0).train()
    x = torch.ones(1, 2, 4, dtype=torch.float64)  # 4 active experts per token > top_k = 1
    r(x)
    r.update_after_step()
    assert float(r.l1_coef) == pytest.approx(2e-3)
    r(-x)  # none active < 1
    r.update_after_step()
    assert float(r.l1_coef) == pytest.approx(1e-3)
    r.eval()(x)
    r.update_after_step()  # eval forwards are not counted, and no forward leaves it as it is
    assert float(r.l1_coef) == pytest.approx(1e-3)


def test_remoe_sparsifies_in_training():
    """The penalty and its controller bring a densely started router to about top_k experts on
    average (the controller oscillates around it). The input has a mean direction, as a
    residual stream has: a bias-free gate on zero-mean symmetric input is positive for half
    the tokens whatever its weights."""
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 16, 8, router="remoe", top_k=2, l1_init=1e-3)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    target = torch.randn(16, 16)
    active = []
    for _ in range(400):
        x = torch.randn(4, 16, 16) + 1.0
        y, routing = layer(x, return_routing=True)
        loss = (y - x @ target).square().mean() + routing.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        moe.update_routers(layer)
        active.append(routing.experts_per_token().double().mean().item())
    assert active[0] > 3.5  # starts nearly dense (4 of 8 for a random gate)
    late = sum(active[200:]) / 200
    assert 1.5 < late < 2.5, late


# -- top-p ------------------------------------------------------------------------------------
def top_p_reference(probs_E: list[float], p: float, max_k: int) -> dict[int, float]:
    order = sorted(range(len(probs_E)), key=lambda e: -probs_E[e])
    kept, mass = [], 0.0
    for e in order:
        if mass >= p or len(kept) == max_k:
            break
        kept.append(e)
        mass += probs_E[e]
    return {e: probs_E[e] / sum(probs_E[k] for k in kept) for e in kept}


@pytest.mark.parametrize("p,max_k", [(0.4, 4), (0.6, 4), (0.9, 2), (1.0, 4)])
def test_top_p_keeps_the_most_probable_experts_until_their_mass_reaches_p(p, max_k):
    torch.manual_seed(1)
    r = identity_router("top_p", 4, p=p, max_k=max_k)
    x = 2 * torch.randn(2, 7, 4, dtype=torch.float64)
    out = r(x)
    probs = torch.softmax(x.reshape(-1, 4), -1)
    expected = {(n, e): w for n in range(14) for e, w in top_p_reference(probs[n].tolist(), p, max_k).items()}
    got = pairs(out)
    assert got.keys() == expected.keys()
    assert [got[k] for k in expected] == pytest.approx(list(expected.values()), rel=1e-12)


def test_top_p_adapts_p_towards_the_target_from_past_batches_only():
    r = identity_router("top_p", 4, p=0.5, target_experts=2.0, p_rate=0.1).train()
    x = torch.zeros(1, 3, 4, dtype=torch.float64)  # uniform: p = 0.5 keeps 2 experts exactly
    before = pairs(r(x))
    r.update_after_step()
    assert float(r.p) == pytest.approx(0.5)
    x[..., 0] = 10.0  # one expert holds all the mass: 1 < 2 experts, p rises
    r(x)
    assert float(r.p) == pytest.approx(0.5)  # a forward alone changes nothing
    r.update_after_step()
    assert float(r.p) == pytest.approx(0.6)
    assert len(before) == 6


# -- null experts -------------------------------------------------------------------------------
def test_dynamic_routers_take_their_bounds_and_refuse_beyond():
    """top_p: p in (0, 1], target_experts in [1, max_k]; ReMoE: top_k in (0, E], l1_rate > 1
    (the penalty must grow when too many experts are active)."""
    build = moe.build_router
    assert build("top_p", d_model=4, num_experts=4, p=1.0, max_k=2, target_experts=2).target_experts == 2.0
    for bad in ({"p": 0.0}, {"p": 1.5}, {"max_k": 2, "target_experts": 3}, {"target_experts": 0.5}):
        with pytest.raises(ValueError, match="must be in"):
            build("top_p", d_model=4, num_experts=4, **bad)
    assert build("remoe", d_model=4, num_experts=4, top_k=4).top_k == 4.0
    for bad, message in (
        ({"top_k": 0}, "top_k must be in"),
        ({"top_k": 5}, "top_k must be in"),
        ({"l1_rate": 1.0}, "l1_rate > 1"),
    ):
        with pytest.raises(ValueError, match=message):
            build("remoe", d_model=4, num_experts=4, **bad)


def test_null_experts_take_choices_that_compute_nothing():
    torch.manual_seed(2)
    r = moe.build_router("topk", d_model=6, num_experts=3, top_k=3, null_experts=3).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    out = r(x)
    logits = torch.cat([r.gate(x.reshape(10, 6)), r.null_gate(x.reshape(10, 6))], 1)
    probs = torch.softmax(logits, -1)
    expected = {}
    for n in range(10):
        top = torch.topk(probs[n], 3).indices.tolist()
        total = sum(probs[n, j].item() for j in top)
        expected.update({(n, j): probs[n, j].item() / total for j in top if j < 3})
    got = pairs(out)
    assert got.keys() == expected.keys()
    assert [got[k] for k in expected] == pytest.approx(list(expected.values()), rel=1e-12)
    served = {n for n, _ in expected}
    assert float(out.stats["dropped_fraction"]) == pytest.approx(1 - len(served) / 10)
    assert float(out.stats["null_fraction"]) == pytest.approx(1 - len(expected) / 30)
    assert r.nominal_experts_per_token() == 1.5
    with pytest.raises(ValueError, match="balance_rate=0"):
        moe.build_router("topk", d_model=6, num_experts=3, null_experts=2, balance_rate=0.01)


# -- Expert Threshold's population statistic ---------------------------------------------------
def test_population_cutoff_is_the_quantile_of_the_whole_population():
    torch.manual_seed(3)
    scores_NE = torch.softmax(2 * torch.randn(5000, 4, dtype=torch.float64), -1)
    bins = 4096
    hist = torch.zeros(4, bins, dtype=torch.float64)
    for e in range(4):
        hist[e] += torch.bincount((scores_NE[:, e] * bins).long().clamp(max=bins - 1), minlength=bins)
    cut = population_cutoff(hist, 0.25)
    exact = torch.sort(scores_NE, 0, descending=True).values[1249]  # the 1250th best of 5000
    assert (cut - exact).abs().max() < 1 / bins


def test_population_threshold_does_not_depend_on_how_the_step_is_cut():
    """One forward of 8 sequences, or 4 microbatches of 2: the same histogram, the same threshold;
    the group statistic's mean of per-sequence cut-offs is a different number."""
    torch.manual_seed(4)
    x = torch.randn(8, 16, 4, dtype=torch.float64)
    whole = identity_router("ec_threshold", 4, statistic="population", capacity_factor=1.0).train()
    parts = identity_router("ec_threshold", 4, statistic="population", capacity_factor=1.0).train()
    whole(x)
    for chunk in x.split(2):
        parts(chunk)
    whole.update_after_step()
    parts.update_after_step()
    assert torch.equal(whole.threshold, parts.threshold)
    group = identity_router("ec_threshold", 4, capacity_factor=1.0).train()
    group(x)
    group.update_after_step()
    exact = torch.sort(torch.softmax(x.reshape(-1, 4), -1), 0, descending=True).values[
        31
    ]  # the 32nd best of 128: a quarter
    assert (whole.threshold - exact).abs().max() < 1 / 4096
    assert (group.threshold - exact).abs().max() > 1e-3


# -- two processes: FSDP2 and expert parallelism equal one process ---------------------------------
DYNAMIC = {
    "remoe": {"top_k": 2, "l1_init": 1e-4},
    "top_p": {"target_experts": 2, "p_rate": 0.01},
    "topk": {"top_k": 2, "null_experts": 4},
    "ec_threshold": {"statistic": "population", "aux_loss_coef": 0.0, "capacity_factor": 2.0},
}
RUN = {**TINY_RUN, "steps": 6}
KEYS = ("loss", "aux_loss", "grad_norm", "active_experts_mean", "max_vio")


def _curves(history: list[dict]) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in KEYS) for r in history]


def _two_rank_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, options in DYNAMIC.items():
        for layout in ("fsdp2", "expert_parallel"):  # two processes shard everything with FSDP2 by default
            ep = {"expert_parallel": 2} if layout == "expert_parallel" else {}
            res = train(TrainConfig.flat(router=name, router_options=options, **ep, **RUN))
            out[(name, layout)] = _curves(res.history)
    return out


def test_dynamic_routers_train_under_fsdp_and_expert_parallelism_like_one_process():
    ref = {
        name: _curves(train(TrainConfig.flat(router=name, router_options=o, **RUN)).history)
        for name, o in DYNAMIC.items()
    }
    got = ok_values(run_local(_two_rank_worker, 2, timeout_s=600))[0]
    for (name, layout), curves in got.items():
        assert len(curves) == 6
        for step, (a, b) in enumerate(zip(curves, ref[name])):
            for key, va, vb in zip(KEYS, a, b):
                assert math.isclose(va, vb, rel_tol=1e-4, abs_tol=1e-6), (
                    f"{name} {layout} step {step + 1} {key}: {va:.7f} vs one process {vb:.7f}"
                )
    assert {c[3] for c in ref["remoe"]} != {2.0}  # the compute per token varies (measured, not set)
