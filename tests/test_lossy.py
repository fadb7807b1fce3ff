"""The lossy transport and data-parallel training over it (moe.parallel.lossy).

Single-process checks of the loss pattern (a pure function of its key, the right rate, the
right burst statistics, independent across keys), then one spawn of 4 gloo processes
(``run_local``) that runs every distributed check and returns numbers the tests assert on:

* p = 0: every lossy policy is bitwise today's all-reduce mean (``reduce_gradients``), and a
  few training steps with it are bitwise the plain data-parallel steps;
* p = 0.3: each policy's shard equals a float64 reference built in the test from every rank's
  gradient and the loss masks; over 400 seeded trials (20 steps of 20 blocks) the ``unbiased`` estimate of i.i.d.
  gradients averages to their expectation within 3 standard errors, ``naive`` to
  (1 + (P - 1)(1 - p)) / P of it, ``reweighted`` to the mean of fixed, distinct gradients;
* expert-parallel exchange at p = 0.3: the lost assignments are those whose row a
  brute-force reading of the dispatch and return packets says is lost, the survivors through
  ``expert_parallel_ffn`` equal the single-process reference on them (float64, 1e-10), and
  renormalised weights keep each surviving token's sum;
* expert-parallel backward at p = 0.3: with the return and dispatch exchanges' gradient rows
  lost (``LossyExpertParallel``), the input, combine-weight and expert gradients equal a
  float64 reference over all ranks' tokens built from a brute-force reading of the packets
  (1e-10), the forward is unchanged, and the reliable path's input gradient differs;
* p = 0.1, 200 steps: the replicas' drift does not grow (second half vs first half, within 3
  standard errors) and stays far below what a replica frozen at step 100 would show; a
  resync every 10 steps makes the replicas equal at those steps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from causal_moe_kernels.reference import moe_ffn_reference
from moe import MoELayer
from moe.experts import SwiGLUExperts
from moe.parallel import ExpertParallel, expert_parallel_ffn, local_expert_range, reduce_gradients
from moe.parallel.launch import ok_values, run_local
from moe.parallel.lossy import (
    LossConfig,
    LossyDataParallel,
    LossyDPConfig,
    LossyTransport,
    Workers,
    aggregate_gradient,
    lost_packets,
    shard_bounds,
)
from moe.parallel.lossy.expert import LossyExpertParallel, drop_lost_assignments, wrap_expert_parallel_routers
from moe.parallel.lossy.transport import expand_packets

WORLD = 4
TRIALS = 400
STEPS = 20
P_STAT = 0.3


# -- single process: the loss pattern --------------------------------------------------------
def test_loss_pattern_is_a_pure_function_of_its_key():
    cfg = LossConfig(rate=0.3, seed=5)
    a = lost_packets(cfg, 7, 2, 0, 3, 50)
    assert torch.equal(a, lost_packets(cfg, 7, 2, 0, 3, 50)), "same key, different pattern"
    assert torch.equal(a[:20], lost_packets(cfg, 7, 2, 0, 3, 20)), "packet k's fate depends on the message length"
    for other in [(8, 2, 0, 3), (7, 3, 0, 3), (7, 2, 1, 3), (7, 2, 0, 2)]:
        assert not torch.equal(a, lost_packets(cfg, *other, 50)), f"{other} repeats the pattern of (7, 2, 0, 3)"
    assert not torch.equal(a, lost_packets(LossConfig(rate=0.3, seed=6), 7, 2, 0, 3, 50))
    assert not lost_packets(cfg, 7, 2, 3, 3, 50).any(), "a rank lost a packet to itself"
    assert not lost_packets(LossConfig(rate=0.0), 7, 2, 0, 3, 50).any()


def test_independent_losses_have_rate_p_and_no_correlation():
    p, n = 0.3, 20_000
    cfg = LossConfig(rate=p, seed=1)
    x = lost_packets(cfg, 0, 0, 0, 1, n).double()
    se = math.sqrt(p * (1 - p) / n)
    assert abs(x.mean() - p) < 3 * se, f"loss rate {x.mean():.4f}, expected {p} +- {3 * se:.4f}"
    # Neighbouring packets, neighbouring steps, the reverse direction: P(both lost) = p^2.
    for name, y in [
        ("next packet", x.roll(1)),
        ("next step", lost_packets(cfg, 1, 0, 0, 1, n).double()),
        ("reverse link", lost_packets(cfg, 0, 0, 1, 0, n).double()),
    ]:
        both = (x * y).mean()
        se2 = math.sqrt(p * p * (1 - p * p) / n)
        assert abs(both - p * p) < 3 * se2, f"{name}: P(both lost) {both:.4f}, expected {p * p:.4f} +- {3 * se2:.4f}"


def test_bursts_have_rate_p_and_mean_length_L():
    p, burst, n = 0.1, 5.0, 200_000
    x = lost_packets(LossConfig(rate=p, burst_length=burst, seed=2), 0, 0, 0, 1, n).numpy()
    assert abs(x.mean() - p) < 0.01, f"burst channel loss rate {x.mean():.4f}, expected {p}"
    stay = (x[1:] & x[:-1]).sum() / x[:-1].sum()
    assert abs(stay - (1 - 1 / burst)) < 0.02, f"P(lost | previous lost) {stay:.3f}, expected {1 - 1 / burst}"
    starts = (x[1:] & ~x[:-1]).sum()
    assert abs(x.sum() / starts - burst) < 0.3, f"mean burst {x.sum() / starts:.2f}, expected {burst}"


def test_bad_configs_raise():
    for kwargs in [
        {"rate": 1.0},
        {"rate": -0.1},
        {"packet_size": 0},
        {"burst_length": 0.5},
        {"rate": 0.9, "burst_length": 1.0},
    ]:
        with pytest.raises(ValueError):
            LossConfig(**kwargs)
    with pytest.raises(ValueError, match="policy"):
        LossyDPConfig(policy="hopeful")


def test_shard_bounds_cover_the_vector():
    for n, size in [(10, 4), (3, 4), (64, 4), (1, 1)]:
        bounds = shard_bounds(n, size)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


# -- distributed worker -----------------------------------------------------------------------
def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)
    model.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().backward()


def _aggregate(flat: torch.Tensor, policy: str, t: LossyTransport) -> torch.Tensor:
    """This rank's shard of the aggregated gradient, one worker per process."""
    return aggregate_gradient(flat[None], policy, t, Workers.from_group())[0]


def _gather_shards(shard, n: int, size: int) -> torch.Tensor:
    """Reliable all-gather of uneven shards into the full vector (test helper)."""
    t = LossyTransport(LossConfig(), None)
    return t.all_gather_stale([shard], torch.zeros(1, n, dtype=shard.dtype), Workers.from_group(), reliable=True)[0]


def _bitwise_checks(rank: int, size: int) -> dict:
    out = {}
    model = _model(0)
    _backward(model, rank, 0)
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    reduce_gradients(model)
    today = torch.cat([p.grad.reshape(-1) for p in params])
    for policy in ("unbiased", "naive", "reweighted"):
        t = LossyTransport(LossConfig(rate=0.0, packet_size=3, seed=1))
        t.begin_step(0)
        full = _gather_shards(_aggregate(flat, policy, t), flat.numel(), size)
        out[f"bitwise_grad/{policy}"] = bool(torch.equal(full, today))
    # Three AdamW steps: plain data parallel vs LossyDataParallel (reliable, and unbiased at p = 0).
    finals = {}
    for name in ("plain", "reliable", "unbiased"):
        m = _model(1)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        dp = LossyDataParallel(
            m,
            opt,
            LossyDPConfig("reliable" if name == "plain" else name, LossConfig(rate=0.0, packet_size=5), grad_clip=0.0),
        )
        for step in range(3):
            _backward(m, rank, step)
            if name == "plain":
                reduce_gradients(m)
                opt.step()
            else:
                dp.step(step)
        finals[name] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    out["bitwise_train/reliable"] = bool(torch.equal(finals["plain"], finals["reliable"]))
    out["bitwise_train/unbiased"] = bool(torch.equal(finals["plain"], finals["unbiased"]))
    return out


def _reference_checks(rank: int, size: int) -> dict:
    """Each policy's shard at p = 0.3 vs a float64 reference from all ranks' gradients."""
    n, cfg = 37, LossConfig(rate=0.3, packet_size=2, seed=3)
    flat = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat)
    lo, hi = shard_bounds(n, size)[rank]
    out = {}
    for step in range(3):
        for policy in ("unbiased", "naive", "reweighted"):
            t = LossyTransport(cfg)
            t.begin_step(step)
            got = _aggregate(flat, policy, t)
            arrived = [
                ~expand_packets(lost_packets(cfg, step, 0, src, rank, cfg.num_packets(hi - lo)), hi - lo, 2)
                for src in range(size)
            ]
            parts = [every[src][lo:hi] * arrived[src] for src in range(size)]
            count = sum(a.double() for a in arrived)
            want = {
                "unbiased": sum(parts) / count,
                "naive": sum(parts) / size,
                "reweighted": (every[rank][lo:hi] + (sum(parts) - parts[rank]) / (1 - cfg.rate)) / size,
            }[policy]
            key = f"reference/{policy}"
            out[key] = max(out.get(key, 0.0), float((got - want).abs().max()))
        out["reference/some_lost"] = out.get("reference/some_lost", 0) + int(count.lt(size).sum())
    return out


def _statistics(rank: int, size: int) -> dict:
    """TRIALS samples of each estimator's mean over a block of 64 elements (16 packets) divided
    by the truth: STEPS steps, each a vector of TRIALS / STEPS blocks (packets of different
    blocks or steps are lost independently, so each block is one trial). Every rank returns
    the same lists (the shards are summed into the full vector)."""
    n, blocks, cfg = 64, TRIALS // STEPS, LossConfig(rate=P_STAT, packet_size=4, seed=11)
    mu = (1.0 + torch.arange(n, dtype=torch.float64) / n).repeat(blocks)
    lo, hi = shard_bounds(n * blocks, size)[rank]
    fixed, fixed_mean = mu * (rank + 1), mu * (size + 1) / 2
    out = {k: [] for k in ("iid/unbiased", "iid/naive", "fixed/reweighted", "fixed/unbiased")}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step * size + rank)
        iid = mu + torch.randn(n * blocks, dtype=torch.float64, generator=g)
        for key, policy, grad, ref in [
            ("iid/unbiased", "unbiased", iid, mu),
            ("iid/naive", "naive", iid, mu),
            ("fixed/reweighted", "reweighted", fixed, fixed_mean),
            ("fixed/unbiased", "unbiased", fixed, fixed_mean),
        ]:
            t = LossyTransport(cfg)
            t.begin_step(step)
            ratio = torch.zeros(n * blocks, dtype=torch.float64)
            ratio[lo:hi] = _aggregate(grad, policy, t) / ref[lo:hi]
            dist.all_reduce(ratio)
            if key == "fixed/unbiased":  # one sample per step: rank 0's shard, where the owner's gradient is smallest
                out[key].append(float(ratio[slice(*shard_bounds(n * blocks, size)[0])].mean()))
            else:
                out[key] += ratio.view(blocks, n).mean(1).tolist()
    return out


def _drift_run(rank: int, size: int, resync_every: int, steps: int) -> dict:
    """A random-walk objective (the gradient is pure noise) trained by SGD over p = 0.1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 3, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp = LossyDataParallel(
        model,
        opt,
        LossyDPConfig(
            "unbiased", LossConfig(rate=0.1, packet_size=4, seed=4), resync_every=resync_every, grad_clip=0.0
        ),
    )
    drift, rms, received, snapshot = [], [], [], None
    for step in range(steps):
        g = torch.Generator().manual_seed(7919 * step + rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        m = dp.step(step)
        drift.append(m["max_drift"])
        rms.append(m["rms_drift"])
        received.append(m["received_fraction"])
        if step == 99:
            snapshot = parameters_to_vector(model.parameters()).detach().clone()
    if snapshot is None:
        return {"max_drift": drift, "rms_drift": rms}
    # what a replica that stopped receiving at step 100 would be off by at step 200
    frozen = parameters_to_vector(model.parameters()).detach() - snapshot
    return {
        "max_drift": drift,
        "rms_drift": rms,
        "frozen_rms": float(frozen.square().mean().sqrt()),
        "frozen_max": float(frozen.abs().max()),
        "per_param": sorted(m["drift"]),
        "received": float(np.mean(received)),
    }


def _experts(num_experts: int, d: int, f: int) -> tuple[SwiGLUExperts, SwiGLUExperts, int, int]:
    """(all experts, this rank's block of them, its first and past-last expert), float64, seed 0."""
    torch.manual_seed(0)
    full = SwiGLUExperts(num_experts, d, f).double()
    start, stop = local_expert_range(num_experts, None)
    local = SwiGLUExperts(stop - start, d, f).double()
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            getattr(local, name).copy_(getattr(full, name)[start:stop])
    return full, local, start, stop


def _expert_checks(rank: int, size: int) -> dict:
    """Expert-parallel exchange under loss: the surviving assignments through
    ``expert_parallel_ffn`` == the single-process reference on them; the lost set == a
    brute-force reading of the two messages' packets; renormalised weights keep each token's sum."""
    num_experts, d, f, n = 4, 8, 12, 10
    full, local, start, stop = _experts(num_experts, d, f)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, d, dtype=torch.float64, generator=g)
    expert_A = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(n)]).reshape(-1)
    token_A = torch.arange(n).repeat_interleave(2)
    weight_A = torch.rand(2 * n, dtype=torch.float64, generator=g) + 0.1
    cfg = LossConfig(rate=0.3, packet_size=4, seed=5)
    out = {"ep/output": 0.0, "ep/renorm_sum": 0.0, "ep/lost_set_matches": True, "ep/lost": 0}
    for renormalise in (False, True):
        t = LossyTransport(cfg)
        t.begin_step(3)
        kept = drop_lost_assignments(token_A, expert_A, weight_A, n, num_experts, d, t, renormalise)
        y = expert_parallel_ffn(x, kept.token_A, kept.expert_A, kept.weight_A, local, num_experts)
        want = moe_ffn_reference(x, kept.token_A, kept.expert_A, kept.weight_A, full.w_gate, full.w_up, full.w_down)
        out["ep/output"] = max(out["ep/output"], float((y - want).abs().max()))
        per_rank = stop - start
        for a in range(2 * n):
            dst = int(expert_A[a]) // per_rank
            same = (expert_A // per_rank == dst) & (
                (expert_A < expert_A[a]) | ((expert_A == expert_A[a]) & (torch.arange(2 * n) < a))
            )
            pos, rows = int(same.sum()), int((expert_A // per_rank == dst).sum())
            there = lost_packets(cfg, 3, 0, rank, dst, cfg.num_packets(rows * d))
            back = lost_packets(cfg, 3, 1, dst, rank, cfg.num_packets(rows * d))
            packets = range(pos * d // 4, ((pos + 1) * d - 1) // 4 + 1)
            lost = any(bool(there[k]) or bool(back[k]) for k in packets)
            out["ep/lost_set_matches"] &= lost == bool(kept.lost_A[a])
        out["ep/lost"] += int(kept.lost_A.sum())
        if renormalise:
            total = torch.zeros(n, dtype=torch.float64).index_add(0, token_A, weight_A)
            got = torch.zeros(n, dtype=torch.float64).index_add(0, kept.token_A, kept.weight_A)
            alive = torch.zeros(n, dtype=torch.bool)
            alive[kept.token_A] = True
            out["ep/renorm_sum"] = float((got - total)[alive].abs().max())
    # Through MoELayer: a wrapped router at p = 0 changes nothing; at p = 0.3 the layer's
    # routing holds the survivors and counts them as drops.
    torch.manual_seed(1)
    layer = MoELayer(
        d, f, num_experts, router="topk", top_k=2, expert_parallel=ExpertParallel(dist.group.WORLD)
    ).double()
    x_BTD = x.view(2, n // 2, d)
    y_plain, r_plain = layer(x_BTD, return_routing=True)
    t = LossyTransport(LossConfig(rate=0.0))
    wrapper, path = wrap_expert_parallel_routers(layer, t)
    t.begin_step(0)
    out["ep/layer_p0_equal"] = bool(torch.equal(layer(x_BTD), y_plain))
    wrapper.transport = path.transport = LossyTransport(cfg)
    wrapper.transport.begin_step(3)
    _, r_lossy = layer(x_BTD, return_routing=True)
    kept_fraction = r_lossy.token.numel() / r_plain.token.numel()
    out["ep/layer_lost"] = float(r_lossy.stats["ep_lost_fraction"])
    out["ep/layer_dropped_consistent"] = (
        abs(
            float(r_lossy.stats["dropped_fraction"])
            - (1 - (1 - float(r_plain.stats["dropped_fraction"])) * kept_fraction)
        )
        < 1e-6
    )  # fp32 stats
    out["ep/layer_kept_matches"] = abs(kept_fraction - (1 - out["ep/layer_lost"])) < 1e-6
    t = LossyTransport(LossConfig(rate=0.0))
    t.begin_step(0)
    none_lost = drop_lost_assignments(token_A, expert_A, weight_A, n, num_experts, d, t, renormalise=True)
    out["ep/p0_identity"] = bool(torch.equal(none_lost.weight_A, weight_A) and torch.equal(none_lost.token_A, token_A))
    return out


def _row_lost(cfg: LossConfig, step: int, stream: int, src: int, dst: int, pos: int, rows: int, d: int) -> bool:
    """Brute force: is row ``pos`` of the ``rows`` x ``d`` message (step, stream, src -> dst) lost,
    i.e. is any packet it overlaps lost?"""
    lost_K = lost_packets(cfg, step, stream, src, dst, cfg.num_packets(rows * d))
    return any(bool(lost_K[k]) for k in range(pos * d // cfg.packet_size, ((pos + 1) * d - 1) // cfg.packet_size + 1))


def _ep_data(rank: int, num_experts: int, d: int, n: int) -> tuple:
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(n, d, dtype=torch.float64, generator=g)
    expert_A = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(n)]).reshape(-1)
    weight_A = torch.rand(2 * n, dtype=torch.float64, generator=g) + 0.1
    grad_out = torch.randn(n, d, dtype=torch.float64, generator=g)
    return x, torch.arange(n).repeat_interleave(2), expert_A, weight_A, grad_out


def _expert_backward_checks(rank: int, size: int) -> dict:
    """Backward exchanges at p = 0.3 (``LossyExpertParallel``): every gradient (input, combine
    weights, local experts) == a float64 single-process reference over all ranks' tokens in
    which an assignment whose output gradient is lost on the way to its expert contributes a
    detached expert output (no expert or input gradient, the weight's kept), and one whose
    input gradient is lost on the way back sees a detached input; the lost rows read
    brute-force from the two messages' packets (streams 0: return backward, 1: dispatch backward)."""
    num_experts, d, f, n, step = 4, 8, 12, 10, 5
    cfg = LossConfig(rate=0.3, packet_size=4, seed=7)
    full, local, start, stop = _experts(num_experts, d, f)
    x, token_A, expert_A, weight_A, grad_out = _ep_data(rank, num_experts, d, n)
    x.requires_grad_(True)
    weight_A.requires_grad_(True)
    t = LossyTransport(cfg)
    t.begin_step(step)
    path = LossyExpertParallel(ExpertParallel(dist.group.WORLD), t)
    y = path(x, token_A, expert_A, weight_A, local, num_experts)
    (y * grad_out).sum().backward()
    y_reliable = expert_parallel_ffn(x.detach(), token_A, expert_A, weight_A.detach(), local, num_experts)
    per_rank, out = num_experts // size, {"epb/lost_returned": 0, "epb/lost_dispatched": 0}
    ref = {name: getattr(full, name).detach().clone().requires_grad_(True) for name in ("w_gate", "w_up", "w_down")}
    total, mine = 0.0, None
    for src in range(size):
        xs, tok, exp, ws, gs = _ep_data(src, num_experts, d, n)
        xs.requires_grad_(True)
        ws.requires_grad_(True)
        ys = torch.zeros(n, d, dtype=torch.float64)
        for a in range(2 * n):
            dst = int(exp[a]) // per_rank
            to_dst = exp // per_rank == dst
            pos = int((to_dst & ((exp < exp[a]) | ((exp == exp[a]) & (torch.arange(2 * n) < a)))).sum())
            rows = int(to_dst.sum())
            returned = _row_lost(cfg, step, 0, src, dst, pos, rows, d)
            dispatched = _row_lost(cfg, step, 1, dst, src, pos, rows, d)
            if src == rank:
                out["epb/lost_returned"] += returned
                out["epb/lost_dispatched"] += dispatched
            x_in = xs[tok[a]].detach() if dispatched or returned else xs[tok[a]]
            weights = [w.detach() if returned else w for w in ref.values()]
            ys = ys.index_add(
                0,
                tok[a : a + 1],
                moe_ffn_reference(
                    x_in[None], torch.zeros(1, dtype=torch.long), exp[a : a + 1], ws[a : a + 1], *weights
                ),
            )
        total = total + (ys * gs).sum()
        if src == rank:
            mine = (xs, ws)
    total.backward()
    out["epb/forward_unchanged"] = bool(torch.allclose(y, y_reliable, rtol=0, atol=1e-12))
    out["epb/x_grad"] = float((x.grad - mine[0].grad).abs().max())
    out["epb/weight_grad"] = float((weight_A.grad - mine[1].grad).abs().max())
    out["epb/expert_grad"] = max(float((getattr(local, k).grad - ref[k].grad[start:stop]).abs().max()) for k in ref)
    # the same step with the reliable path: the losses must change the gradients (not vacuous)
    x2 = x.detach().clone().requires_grad_(True)
    path.enabled = False
    (path(x2, token_A, expert_A, weight_A.detach(), local, num_experts) * grad_out).sum().backward()
    out["epb/reliable_x_grad_differs"] = float((x2.grad - x.grad).abs().max())
    return out


def _worker(rank: int, size: int) -> dict:
    return {
        **_bitwise_checks(rank, size),
        **_reference_checks(rank, size),
        **_expert_checks(rank, size),
        **_expert_backward_checks(rank, size),
        "stats": _statistics(rank, size),
        "drift": _drift_run(rank, size, 0, 200),
        "drift_resync": _drift_run(rank, size, 10, 100),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return ok_values(run_local(_worker, WORLD, timeout_s=300.0))


# -- distributed tests ------------------------------------------------------------------------
def test_zero_loss_is_bitwise_the_reliable_all_reduce(results):
    for rank, res in enumerate(results):
        bad = [k for k, v in res.items() if k.startswith("bitwise") and v is not True]
        assert not bad, f"rank {rank}: not bitwise equal to reduce_gradients / plain steps: {bad}"


def test_policies_match_a_float64_reference(results):
    for rank, res in enumerate(results):
        assert res["reference/some_lost"] > 0, f"rank {rank}: nothing was lost, the reference check is vacuous"
        for policy in ("unbiased", "naive", "reweighted"):
            assert res[f"reference/{policy}"] < 1e-12, (
                f"rank {rank} {policy}: max diff {res[f'reference/{policy}']:.3e}"
            )


def _mean_se(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values)
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(a.size))


def test_unbiased_is_unbiased_and_naive_shrinks_by_the_expected_factor(results):
    stats = results[0]["stats"]
    assert all(r["stats"] == stats for r in results), "ranks disagree on the aggregated statistics"
    q = 1 - P_STAT
    mean, se = _mean_se(stats["iid/unbiased"])
    assert abs(mean - 1) < 3 * se, f"unbiased: E[estimate / truth] = {mean:.4f} +- {se:.4f}, expected 1"
    naive_factor = (1 + (WORLD - 1) * q) / WORLD
    mean, se = _mean_se(stats["iid/naive"])
    assert abs(mean - naive_factor) < 3 * se, f"naive: {mean:.4f} +- {se:.4f}, expected {naive_factor:.4f}"
    assert (1 - mean) > 10 * se, "naive's bias is not resolved: the test could not tell it from unbiased"
    mean, se = _mean_se(stats["fixed/reweighted"])
    assert abs(mean - 1) < 3 * se, f"reweighted on fixed gradients: {mean:.4f} +- {se:.4f}, expected 1"
    # 'unbiased' on fixed, distinct gradients g_i = (i + 1) mu: on rank 0's shard the owner's
    # gradient mu is weighted by E[1/M], M = 1 + Binomial(P - 1, q), each other rank's by
    # (1 - E[1/M]) / (P - 1): unbiased for the true gradient when the g_i share an expectation,
    # not for the mean of these particular, different gradients (the module docstring's caveat).
    e_inv = sum(math.comb(WORLD - 1, k) * q**k * (1 - q) ** (WORLD - 1 - k) / (1 + k) for k in range(WORLD))
    total = WORLD * (WORLD + 1) / 2
    want = (e_inv * 1 + (1 - e_inv) / (WORLD - 1) * (total - 1)) / (total / WORLD)
    mean, se = _mean_se(stats["fixed/unbiased"])
    assert abs(mean - want) < 3 * se, f"unbiased on fixed gradients: {mean:.4f} +- {se:.4f}, expected {want:.4f}"
    assert abs(1 - want) > 5 * se, "the owner's extra weight is not resolved: the check is vacuous"


def test_expert_parallel_loss_drops_assignments(results):
    for rank, res in enumerate(results):
        assert res["ep/lost"] > 0, f"rank {rank}: no assignment lost at p = 0.3: the check is vacuous"
        assert res["ep/lost_set_matches"], f"rank {rank}: lost assignments differ from the packets' reading"
        assert res["ep/output"] < 1e-10, f"rank {rank}: EP output vs reference on survivors {res['ep/output']:.3e}"
        assert res["ep/renorm_sum"] < 1e-12, (
            f"rank {rank}: renormalised weights lost their sum {res['ep/renorm_sum']:.3e}"
        )
        assert res["ep/p0_identity"], f"rank {rank}: p = 0 changed the assignments"
        assert res["ep/layer_p0_equal"], f"rank {rank}: a LossyRouter at p = 0 changed the layer's output"
        assert res["ep/layer_kept_matches"], (
            f"rank {rank}: survivors do not match ep_lost_fraction {res['ep/layer_lost']}"
        )
        assert res["ep/layer_dropped_consistent"], f"rank {rank}: dropped_fraction does not count the lost assignments"
    assert sum(r["ep/layer_lost"] for r in results) > 0, "no assignment lost through the layer: vacuous"


def test_expert_parallel_backward_loss_drops_gradient_rows(results):
    for rank, res in enumerate(results):
        assert res["epb/lost_returned"] > 0 and res["epb/lost_dispatched"] > 0, (
            f"rank {rank}: no gradient row lost ({res['epb/lost_returned']}, {res['epb/lost_dispatched']}): vacuous"
        )
        assert res["epb/forward_unchanged"], f"rank {rank}: backward losses changed the forward output"
        for key in ("epb/x_grad", "epb/weight_grad", "epb/expert_grad"):
            assert res[key] < 1e-10, f"rank {rank}: {key} vs the float64 reference: max diff {res[key]:.3e}"
        assert res["epb/reliable_x_grad_differs"] > 1e-3, (
            f"rank {rank}: the lost rows did not change the input gradient"
        )


def test_drift_stays_bounded(results):
    res = results[0]["drift"]
    assert all(r["drift"]["max_drift"] == res["max_drift"] for r in results), "ranks measured different drifts"
    assert 0.88 < res["received"] < 0.92, f"mean received fraction {res['received']:.3f} at p = 0.1"
    rms = np.asarray(res["rms_drift"])
    assert rms[100:].max() > 0, "no drift at all: the loss never reached the broadcast"
    # The per-step drift is a stationary sequence with short memory (a stale gap is geometric,
    # mean 0.11 steps), so the two halves' means differ by sampling noise only: compare within
    # 3 standard errors of the difference. Growth like a random walk (sqrt t) would put the
    # second half's mean 40% above the first's.
    (early, se_early), (late, se_late) = _mean_se(rms[10:100].tolist()), _mean_se(rms[100:].tolist())
    assert late <= early + 3 * math.hypot(se_early, se_late), (
        f"RMS drift grew: steps 10-100 {early:.2e} +- {se_early:.1e}, steps 100-200 {late:.2e} +- {se_late:.1e}"
    )
    # A replica frozen at step 100 (a never-resynced random walk) is off by frozen_rms at step
    # 200; the lossy replicas' worst drift over steps 100-200 stays far below it.
    assert max(res["max_drift"][100:]) < 0.5 * res["frozen_max"], (
        f"max drift {max(res['max_drift'][100:]):.3e} vs frozen replica {res['frozen_max']:.3e}"
    )
    assert late < 0.1 * res["frozen_rms"], f"RMS drift {late:.3e} vs frozen replica {res['frozen_rms']:.3e}"
    assert res["per_param"] == ["0.weight", "1.weight"]


def test_resync_every_k_steps_equalises_the_replicas(results):
    res, base = results[0]["drift_resync"], results[0]["drift"]
    at_resync = [res["max_drift"][s] for s in range(0, 100, 10)]
    assert max(at_resync) == 0.0, f"replicas differ right after a resync: {max(at_resync):.3e}"
    assert max(base["max_drift"][s] for s in range(0, 100, 10)) > 0, "the same steps drift without resync: vacuous"
    assert np.mean(res["rms_drift"]) <= np.mean(base["rms_drift"][:100])
