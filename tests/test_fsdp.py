"""FSDP2 x expert parallelism on a DeviceMesh (``moe.parallel.mesh``) reproduces one process.

12 steps of the tiny preset on 4 gloo processes in every layout, for a stateless router
(``topk``) and one with router state synchronised across ranks (``ec_threshold``): per-step
loss, aux loss and gradient norm equal the single-process run to 1e-4 relative (measured:
~1e-7, fp32 rounding of a different summation order). The gradient norm is compared because
AdamW is nearly invariant to a constant gradient scale: an expert gradient off by a factor
(the failure mode of a wrong divide factor, measured at 2x and 1/W while building this) moves
the norm by percents but the losses only by ~1e-5. All layouts run inside one spawn (process
start-up dominates on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_RUN
from torch import nn

from moe.parallel import rank_state_bytes
from moe.parallel.launch import ok_values, run_local
from moe.parallel.mesh import Layout, fsdp_units
from moe.training import TrainConfig, train

COMMON = TINY_RUN
LAYOUTS = {"dp_shard4": (1, 1), "dp_shard2_ep2": (1, 2), "ep4": (1, 4), "dp_replicate2_ep2": (2, 2)}
ROUTERS = ("topk", "ec_threshold")
REL_TOL = 1e-4
KEYS = ("loss", "aux_loss", "grad_norm")


def _curves(history: list[dict]) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in KEYS) for r in history]


def _layouts_worker(rank: int, world: int, router: str) -> dict:
    out = {}
    for name, (r, p) in LAYOUTS.items():
        res = train(TrainConfig.flat(router=router, dp_replicate=r, expert_parallel=p, **COMMON))
        out[name] = (_curves(res.history), rank_state_bytes(res.model, res.optimizer))
    return out


@pytest.mark.parametrize("router", [ROUTERS[0], pytest.param(ROUTERS[1], marks=pytest.mark.slow)])
def test_every_layout_matches_single_process(router):
    res = train(TrainConfig.flat(router=router, **COMMON))
    ref, full_bytes = _curves(res.history), rank_state_bytes(res.model, res.optimizer)["total"]
    per_rank = ok_values(run_local(_layouts_worker, 4, router, timeout_s=600))
    for name, (curves, _) in per_rank[0].items():
        assert len(curves) == len(ref) == 12
        for i, key in enumerate(KEYS):
            rel = [abs(a[i] - b[i]) / abs(b[i]) for a, b in zip(curves, ref)]
            worst = max(range(12), key=rel.__getitem__)
            assert rel[worst] <= REL_TOL, (
                f"{router} {name}: {key} at step {worst + 1}: {curves[worst][i]:.7f} vs single {ref[worst][i]:.7f}"
            )
    # Sharded state: params + grads + AdamW moments per rank under plain FSDP2 on 4 ranks.
    worst = max(res["dp_shard4"][1]["total"] for res in per_rank)
    assert worst <= 0.3 * full_bytes, f"dp_shard 4 holds {worst} bytes per rank vs {full_bytes} on one process"


def test_layout_validation():
    assert Layout.from_world(8, dp_replicate=2, expert_parallel=2) == Layout(2, 2, 2)
    assert Layout.from_world(4).dp_shard == 4
    with pytest.raises(ValueError, match="must divide the number of processes"):
        Layout.from_world(4, expert_parallel=3)
    with pytest.raises(ValueError, match="must divide the number of processes"):
        Layout.from_world(4, dp_replicate=2, expert_parallel=4)
    with pytest.raises(ValueError, match="positive integer"):
        Layout.from_world(4, expert_parallel=0)
    with pytest.raises(ValueError, match="must divide num_experts=6"):
        Layout.from_world(4, expert_parallel=4).check_experts(6)
    Layout.from_world(4, expert_parallel=2).check_experts(6)


def test_a_pipelined_layout_shards_over_the_ranks_of_one_stage():
    """8 processes in 2 stages: 4 ranks per stage, S = 8 / (Q*R*P) by hand."""
    assert Layout.from_world(8, pipeline=2) == Layout(1, 4, 1, 2)
    assert Layout.from_world(8, dp_replicate=2, expert_parallel=2, pipeline=2) == Layout(2, 1, 2, 2)
    layout = Layout.from_world(12, expert_parallel=2, pipeline=3)
    assert (layout.dp_shard, layout.data_parallel, layout.world_size) == (2, 4, 12)
    assert str(layout) == "pp=3 x dp_replicate=1 x dp_shard=2 x ep=2"


def test_fsdp_units_take_each_child_of_at_least_its_share_then_the_block():
    """A block of 56 parameters: a child of 7 (exactly 1/8) is a unit, one of 49 too, a child
    without parameters is not; the block comes after its children."""
    block = nn.Module()
    block.small, block.big, block.empty = nn.Linear(7, 1, bias=False), nn.Linear(7, 7, bias=False), nn.Identity()
    assert fsdp_units([block]) == [block.small, block.big, block]
    assert fsdp_units([block], min_fraction=0.5) == [block.big, block]


def test_rank_state_bytes_counts_adam_state():
    model = torch.nn.Linear(4, 3, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    got = rank_state_bytes(model, opt)
    assert got["params"] == got["grads"] == 48
    assert got["optimizer"] == 2 * 48 + opt.state[model.weight]["step"].element_size()
    assert got["total"] == sum(got[k] for k in ("params", "grads", "optimizer"))
