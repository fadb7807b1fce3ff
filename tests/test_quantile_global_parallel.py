"""Both quantile-balancing scopes across layouts, on gloo processes, equal to one process.

* ``quantile_global`` (Megatron-Core's ``global_batch`` scope): the step's histograms count
  integers, so one process forwarding the whole batch at once, one process accumulating 4
  microbatches, P ranks x 2 microbatches (data parallel, the routers' ``stats_group`` the
  world) and P expert-parallel ranks each forwarding its share give every layer the same
  histograms, exactly, and the same bias (tolerance 1e-12: the float64 model's router inputs
  may differ in the last bits between layouts; a required bias would have to fall that close
  to a bin edge to change a count). The bias is solved in the optimiser pre-step hook, one
  all-reduce for both layers.
* ``quantile`` (``micro_batch`` scope, Megatron-Core's default): the mean of per-microbatch
  biases, so the same microbatches give the same bias whichever rank runs them (tolerance
  1e-6: its float32 buffers are averaged over the ranks in another order), and cutting the
  step differently changes it (shown, so that the first check can fail).
* slow: the trainer with ``quantile_global`` under FSDP2, gradient accumulation and expert
  parallelism on 4 processes gives the single-process run's losses and biases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TINY_RUN, small_lm

import moe
from moe.model import MoETransformer
from moe.parallel import ExpertParallel, load_full_state_dict, share_router_statistics
from moe.parallel.launch import ok_values, run_local
from moe.routers.quantile_global import register_quantile_balancing_hook
from moe.training import TrainConfig, train
from moe.training.distributed import DistInfo, sync_router_state

SEQS, V = 8, 32


def _batch() -> torch.Tensor:
    return torch.randint(0, V, (SEQS, 10), generator=torch.Generator().manual_seed(3))


def _step(model: MoETransformer, chunks: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """One optimiser step (SGD, lr 0: the weights stay) over ``chunks``; (histograms, biases). The
    hook solves both layers with one all-reduce (none without a group)."""
    share_router_statistics(model, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    register_quantile_balancing_hook(opt, model)
    for c in chunks:
        model(c, c).loss.backward()
    counted = [r.histogram_ER.clone() for r in model.routers()]
    if group is not None:
        for h in counted:
            dist.all_reduce(h, group=group)
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        opt.step()
    finally:
        dist.all_reduce = real
    assert len(calls) == (group is not None), f"the pre-step hook ran {len(calls)} all-reduces for 2 layers"
    return counted + [r.balance_bias.clone() for r in model.routers()]


def _global_layouts(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    idx = _batch()
    share = idx.chunk(world)[rank]
    lm = lambda: small_lm("quantile_global", {"top_k": 2}, torch.float64)  # noqa: E731 (init_seed fixed)
    out = {
        "one_forward": _step(lm(), [idx]),
        "accumulate4": _step(lm(), list(idx.chunk(4))),
        f"dp{world}x2": _step(lm(), list(share.chunk(2)), dist.group.WORLD),
    }
    full = lm()
    ep = MoETransformer(full.cfg, expert_parallel=ExpertParallel(dist.group.WORLD), init_seed=1).double()
    load_full_state_dict(ep, full.state_dict())
    out[f"ep{world}"] = _step(ep, [share], dist.group.WORLD)
    return out


def _micro_batch_scope(rank: int, world: int) -> dict[str, torch.Tensor]:
    idx = _batch()
    lm = lambda: small_lm("quantile", {"top_k": 2}, torch.float64)  # noqa: E731
    micro = list(idx.chunk(4))

    def beta(chunks, group=None) -> torch.Tensor:
        model = lm()
        for c in chunks:
            model(c, c)
        if group is not None:
            sync_router_state(model, DistInfo(rank, world, rank, torch.device("cpu")), group)
        moe.update_routers(model)
        return torch.cat([r.beta for r in model.routers()])

    return {
        "accumulate4": beta(micro),
        "one_forward": beta([idx]),
        f"dp{world}": beta(micro[rank * 4 // world : (rank + 1) * 4 // world], dist.group.WORLD),
    }


def _worker(rank: int, world: int):
    return _global_layouts(rank, world), _micro_batch_scope(rank, world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_both_scopes_give_every_layout_the_single_process_bias(world):
    for rank, (global_scope, micro_scope) in enumerate(ok_values(run_local(_worker, world))):
        ref = global_scope.pop("one_forward")
        layers = len(ref) // 2
        assert layers == 2 and all(h.sum() == SEQS * 10 * 4 for h in ref[:layers])  # N tokens x E experts
        assert all(b.abs().sum() > 0 for b in ref[layers:])
        for name, got in global_scope.items():
            for i in range(layers):
                assert torch.equal(got[i], ref[i]), f"rank {rank} {name} layer {i}: histograms differ"
                diff = (got[layers + i] - ref[layers + i]).abs().max().item()
                assert diff <= 1e-12, f"rank {rank} {name} layer {i}: bias differs by {diff:.2e}"
        want = micro_scope["accumulate4"]
        diff = (micro_scope[f"dp{world}"] - want).abs().max().item()
        assert diff <= 1e-6, f"rank {rank} quantile over dp{world}: beta differs by {diff:.2e}"
        assert (micro_scope["one_forward"] - want).abs().max() > 1e-3  # the micro_batch scope depends on the cut


LAYOUTS = {"dp4": dict(), "dp_shard2_ep2": dict(expert_parallel=2), "dp_replicate2_shard2": dict(dp_replicate=2)}
RUN = dict(router="quantile_global", router_options={"top_k": 2}, microbatches=2, **TINY_RUN)


def _final(res) -> tuple[list[float], torch.Tensor]:
    routers = [m for m in res.model.modules() if isinstance(m, moe.Router)]
    return [r["loss"] for r in res.history], torch.cat([r.balance_bias for r in routers])


def _trainer_worker(rank: int, world: int) -> dict:
    return {name: _final(train(TrainConfig.flat(**layout, **RUN))) for name, layout in LAYOUTS.items()}


@pytest.mark.slow
def test_trainer_under_fsdp2_accumulation_and_expert_parallelism_matches_one_process():
    losses, bias = _final(train(TrainConfig.flat(**RUN)))
    assert bias.abs().sum() > 0
    for name, (got_losses, got_bias) in ok_values(run_local(_trainer_worker, 4, timeout_s=900))[0].items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(got_losses, losses))
        assert len(got_losses) == len(losses) == 12 and rel <= 1e-4, f"{name}: losses differ by {rel:.2e} (relative)"
        # fp32 training: the biases follow the weights, which agree to rounding
        assert (got_bias - bias).abs().max() <= 1e-3, f"{name}: biases {got_bias} vs {bias}"
