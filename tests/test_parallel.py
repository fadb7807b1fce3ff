"""Expert parallelism on P gloo CPU processes == the single-process layer with the same weights.

Every multi-process check runs inside one spawn per world size (process start-up dominates
on 2 cores). Workers compare in float64 against a single-process reference computed in the
same worker on the full global batch, and return max absolute differences; the parent
asserts. The EP path performs the same floating-point operations as the reference up to the
order of the cross-rank sum of the router gradient: measured, outputs and every gradient
agree bitwise in float64 and the summed router gradient to ~6e-14. Tolerance 1e-10 leaves
room for BLAS blocking differences while still catching any wrong row, scale or
permutation (those give differences of order 1).

Processes come from ``moe.parallel.launch.run_local``: no fixed ports (a FileStore in a
temporary directory), a timeout on every join, a worker's traceback shown in the failure.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from causal_moe_kernels.reference import moe_ffn_reference
from moe import MoELayer, update_routers
from moe.model import ModelConfig, MoETransformer
from moe.parallel import (
    ExpertParallel,
    expert_parallel_ffn,
    full_state_dict,
    load_full_state_dict,
    local_expert_range,
    reduce_gradients,
    share_router_statistics,
)
from moe.parallel.launch import ok_values, run_local
from moe.training.distributed import DistInfo, sync_router_state

TOL = 1e-10


# -- workers --------------------------------------------------------------------------------
E, D, F, T = 4, 8, 12, 6
CASES = {
    "topk": ("topk", {"top_k": 2}, False),
    "capacity": ("capacity", {"top_k": 2, "capacity_factor": 0.5}, False),
    "capacity_score": ("capacity", {"top_k": 2, "capacity_factor": 0.75, "priority": "score"}, False),
    "expert_choice": ("expert_choice", {"capacity_factor": 1.0}, False),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 1.0}, False),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 1.0}, False),
    "ec_threshold_population": ("ec_threshold", {"statistic": "population", "score": "sigmoid"}, False),
    "remoe": ("remoe", {"top_k": 2}, False),
    "top_p": ("top_p", {"target_experts": 2}, False),
    "topk_null": ("topk", {"top_k": 2, "null_experts": 2}, False),
    # Every token prefers experts 0 and 1: ranks holding only experts >= 2 receive no row.
    "topk_skewed": ("topk", {"top_k": 2}, True),
    "capacity_skewed": ("capacity", {"top_k": 2, "capacity_factor": 1.0}, True),
}


BATCH_GROUPED = {
    "capacity": {"top_k": 2, "capacity_factor": 0.5, "group": "batch"},
    "expert_choice": {"capacity_factor": 0.5, "group": "batch"},
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_diff(a, b) / max(float(b.detach().abs().max()), 1e-30)


def _inputs(world: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    x = torch.randn(2 * world, T, D, dtype=torch.float64)
    if skewed:
        x[..., 0] = 10.0
    return x, torch.randn(2 * world, T, D, dtype=torch.float64)


def _layer_pair(name: str, opts: dict, skewed: bool, group) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(1)
    full = MoELayer(D, F, E, router=name, **opts).double()
    if skewed:
        with torch.no_grad():
            full.router.gate.weight[:, 0] = torch.tensor([1.0, 0.8, -1.0, -1.0])
    ep = MoELayer(D, F, E, router=name, expert_parallel=ExpertParallel(group), **opts).double()
    load_full_state_dict(ep, full.state_dict())
    return full, ep


def _equivalence_worker(rank: int, world: int) -> dict[str, float]:
    group = dist.group.WORLD
    out: dict[str, float] = {}
    rows = slice(2 * rank, 2 * rank + 2)
    for case, (name, opts, skewed) in CASES.items():
        full, ep = _layer_pair(name, opts, skewed, group)
        x, g = _inputs(world, skewed)
        x_full = x.clone().requires_grad_()
        y_full, routing = full(x_full, return_routing=True)
        (y_full * g).sum().backward()
        x_r = x[rows].clone().requires_grad_()
        y_r = ep(x_r)
        (y_r * g[rows]).sum().backward()
        start, stop = ep.local_experts
        out[f"{case}/rows_received"] = float(((routing.expert >= start) & (routing.expert < stop)).sum())
        out[f"{case}/output"] = _max_diff(y_r, y_full[rows])
        out[f"{case}/input_grad"] = _max_diff(x_r.grad, x_full.grad[rows])
        for w in ("w_gate", "w_up", "w_down"):
            out[f"{case}/{w}_grad"] = _max_diff(getattr(ep.experts, w).grad, getattr(full.experts, w).grad[start:stop])
        gate_grad = ep.router.gate.weight.grad.clone()
        dist.all_reduce(gate_grad)
        out[f"{case}/router_grad_summed"] = _max_diff(gate_grad, full.router.gate.weight.grad)
        out[f"{case}/output_nonzero"] = float(y_full.detach().abs().max())

    # Routers grouped over the batch route each rank's shard as a batch of its own: EP equals
    # a single process run on the shard alone (and differs from one on the full batch).
    for name, opts in BATCH_GROUPED.items():
        full, ep = _layer_pair(name, opts, False, group)
        x, _ = _inputs(world, False)
        y_ep = ep(x[rows])
        out[f"{name}_batch/vs_shard_alone"] = _max_diff(y_ep, full(x[rows]))
        out[f"{name}_batch/vs_full_batch"] = _max_diff(y_ep, full(x)[rows])

    # A rank with no tokens at all (N = 0) beside one whose tokens cover every expert,
    # through the data path directly (hand-built assignments; expert 3 gets none).
    torch.manual_seed(3)
    full = MoELayer(D, F, E).double()
    ep = MoELayer(D, F, E, expert_parallel=ExpertParallel(group)).double()
    load_full_state_dict(ep, full.state_dict())
    x0 = torch.randn(3, D, dtype=torch.float64)
    token0, expert0 = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 2, 1, 1, 0])
    weight0 = torch.rand(5, dtype=torch.float64)
    if rank == 0:
        x_n, token, expert, weight = x0.clone().requires_grad_(), token0, expert0, weight0.clone().requires_grad_()
    else:
        x_n = torch.zeros(0, D, dtype=torch.float64, requires_grad=True)
        token = expert = torch.zeros(0, dtype=torch.int64)
        weight = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    y_n = expert_parallel_ffn(x_n, token, expert, weight, ep.experts, E, group)
    y_n.square().sum().backward()
    x_ref, w_ref = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
    ws = [p.detach().clone().requires_grad_() for p in (full.experts.w_gate, full.experts.w_up, full.experts.w_down)]
    y_ref = moe_ffn_reference(x_ref, token0, expert0, w_ref, *ws)
    y_ref.square().sum().backward()
    start, stop = ep.local_experts
    if rank == 0:
        out["empty_rank/output"] = _max_diff(y_n, y_ref)
        out["empty_rank/input_grad"] = _max_diff(x_n.grad, x_ref.grad)
        out["empty_rank/weight_grad"] = _max_diff(weight.grad, w_ref.grad)
    else:
        out["empty_rank/output_rows"] = float(y_n.shape[0])
    for w, ref in zip(("w_gate", "w_up", "w_down"), ws):
        out[f"empty_rank/{w}_grad"] = _max_diff(getattr(ep.experts, w).grad, ref.grad[start:stop])

    # E not divisible by P: a clear error.
    try:
        local_expert_range(3, group)
        out["indivisible_raises"] = 0.0
    except ValueError as e:
        out["indivisible_raises"] = float("divisible" in str(e))
    return out


def _training_worker(rank: int, world: int) -> dict[str, float]:
    """Mean losses (aux loss included) + reduce_gradients == the single-process gradient of
    the global mean loss; router state sync; a model and its checkpoint round trip."""
    group = dist.group.WORLD
    out: dict[str, float] = {}
    rows = slice(2 * rank, 2 * rank + 2)
    full, ep = _layer_pair("topk", {"top_k": 2, "balance_rate": 0.1, "aux_loss_coef": 0.5}, False, group)
    share_router_statistics(ep, group)
    x, g = _inputs(world, False)
    y_full, routing_full = full(x, return_routing=True)
    ((y_full * g).sum(-1).mean() + routing_full.aux_loss).backward()
    y_r, routing_r = ep(x[rows], return_routing=True)
    ((y_r * g[rows]).sum(-1).mean() + routing_r.aux_loss).backward()
    aux_mean = routing_r.aux_loss.detach().clone()
    dist.all_reduce(aux_mean)
    out["mean_loss/aux_loss_rel"] = _rel_diff(aux_mean / world, routing_full.aux_loss)
    reduce_gradients(ep)
    start, stop = ep.local_experts
    out["mean_loss/router_grad"] = _max_diff(ep.router.gate.weight.grad, full.router.gate.weight.grad)
    for w in ("w_gate", "w_up", "w_down"):
        out[f"mean_loss/{w}_grad"] = _max_diff(getattr(ep.experts, w).grad, getattr(full.experts, w).grad[start:stop])

    # Same step reduced in bf16 (eval mode: same routing, no second load record).
    ep.zero_grad()
    ep.eval()
    y_r, routing_r = ep(x[rows], return_routing=True)
    ((y_r * g[rows]).sum(-1).mean() + routing_r.aux_loss).backward()
    ep.train()
    info = reduce_gradients(ep, reduce_dtype=torch.bfloat16)
    out["bf16/rel_diff"] = info["grad_reduce_rel_diff"]
    out["bf16/applied_vs_fp32"] = _max_diff(ep.router.gate.weight.grad, full.router.gate.weight.grad)

    sync_router_state(ep, DistInfo(rank, world, rank, torch.device("cpu")))
    update_routers(full)
    update_routers(ep)
    out["router_state/balance_bias"] = _max_diff(ep.router.balance_bias, full.router.balance_bias)
    out["router_state/bias_nonzero"] = float(full.router.balance_bias.abs().max())

    cfg = ModelConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, moe_d_ff=16, num_experts=E, max_seq_len=16
    )
    torch.manual_seed(4)
    full_model = MoETransformer(cfg).double()
    ep_model = MoETransformer(cfg, expert_parallel=ExpertParallel(group)).double()
    load_full_state_dict(ep_model, full_model.state_dict())
    idx = torch.randint(0, 32, (2 * world, 8), generator=torch.Generator().manual_seed(5))
    out["model/logits"] = _max_diff(ep_model(idx[rows]).logits, full_model(idx).logits[rows])
    gathered = full_state_dict(ep_model)
    reference = full_model.state_dict()
    out["model/checkpoint_keys_match"] = float(set(gathered) == set(reference))
    out["model/checkpoint"] = max(_max_diff(gathered[k], reference[k]) for k in reference)
    return out


def _dead_rank_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 dies between forward and backward; rank 0 must fail fast and clearly."""
    _, ep = _layer_pair("topk", {"top_k": 2}, False, dist.group.WORLD)
    x, _ = _inputs(world, False)
    y = ep(x[2 * rank : 2 * rank + 2].clone().requires_grad_())
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        y.sum().backward()
    except RuntimeError as e:
        return {"error": str(e), "elapsed_s": time.monotonic() - start}
    return {"error": None, "elapsed_s": time.monotonic() - start}


# -- tests ----------------------------------------------------------------------------------
def _check_equivalence(world: int) -> None:
    per_rank = ok_values(run_local(_equivalence_worker, world))
    for rank, res in enumerate(per_rank):
        for key, v in res.items():
            if key.endswith(("rows_received", "output_nonzero", "output_rows", "vs_full_batch")):
                continue
            if key == "indivisible_raises":
                assert v == 1.0, f"rank {rank}: E=3 over {world} ranks did not raise a clear ValueError"
                continue
            assert v <= TOL, f"rank {rank} {key}: max |EP - single| = {v:.3e} > {TOL}"
        for case in CASES:
            assert res[f"{case}/output_nonzero"] > 0.1, f"{case}: degenerate test (all-zero output)"
        if rank > 0:
            assert res["empty_rank/output_rows"] == 0.0
    for name in BATCH_GROUPED:
        worst = max(res[f"{name}_batch/vs_full_batch"] for res in per_rank)
        assert worst > 1e-3, f"{name} group=batch: EP matched the full-batch routing; the shard check is vacuous"
    # The skewed cases must really leave some rank with no rows, and the plain ones none.
    for case in ("topk_skewed", "capacity_skewed"):
        received = [res[f"{case}/rows_received"] for res in per_rank]
        assert received[0] > 0 and received[-1] == 0, f"{case}: rows received per rank {received}"
    assert all(res["topk/rows_received"] > 0 for res in per_rank)


def test_expert_parallel_equals_single_process_2_ranks():
    _check_equivalence(2)


@pytest.mark.slow
def test_expert_parallel_equals_single_process_4_ranks():
    _check_equivalence(4)


def test_gradient_reduction_router_state_and_checkpoints():
    for rank, res in enumerate(ok_values(run_local(_training_worker, 2))):
        assert res["mean_loss/aux_loss_rel"] <= 1e-6, (
            f"rank {rank}: aux loss rel diff {res['mean_loss/aux_loss_rel']:.3e}"
        )
        for key in (
            "mean_loss/router_grad",
            "mean_loss/w_gate_grad",
            "mean_loss/w_up_grad",
            "mean_loss/w_down_grad",
            "router_state/balance_bias",
            "model/logits",
            "model/checkpoint",
        ):
            assert res[key] <= TOL, f"rank {rank} {key}: max diff {res[key]:.3e} > {TOL}"
        assert res["router_state/bias_nonzero"] > 0, "balancing bias never moved: the sync check is vacuous"
        assert res["model/checkpoint_keys_match"] == 1.0
        # bf16 reduction: a real but small difference (bf16 has 8 mantissa bits: ~4e-3 per value).
        assert 0 < res["bf16/rel_diff"] < 2e-2, f"bf16 vs fp32 relative difference {res['bf16/rel_diff']:.3e}"
        assert 0 < res["bf16/applied_vs_fp32"] < 1e-1


def test_dead_rank_gives_clear_error_not_a_hang():
    pg_timeout_s = 30.0
    results = run_local(_dead_rank_worker, 2, timeout_s=120.0, pg_timeout_s=pg_timeout_s)
    status, res = results[0]
    assert status == "ok", res
    assert res["error"] is not None, "rank 0 finished its backward although rank 1 was dead"
    assert "expert-parallel row exchange failed on rank 0 of 2" in res["error"], res["error"]
    assert res["elapsed_s"] < pg_timeout_s + 10, f"took {res['elapsed_s']:.1f}s to notice"
    assert results[1][0] == "missing"


def test_expert_parallel_needs_initialised_distributed():
    with pytest.raises(ValueError, match="torch.distributed"):
        ExpertParallel(object())


def _imported_modules(path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layer_and_parallel_do_not_import_each_other():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "moe"
    layer_imports = _imported_modules(root / "layer.py")
    assert not any(m.startswith("moe.parallel") for m in layer_imports), layer_imports
    for path in (root / "parallel").glob("*.py"):
        bad = {
            m for m in _imported_modules(path) if m in ("moe", "moe.layer", "moe.model") or m.startswith("moe.training")
        }
        assert not bad, f"{path.name} imports {bad}"
