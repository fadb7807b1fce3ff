"""Meta-device construction: a model built with its parameters on the meta device, placed
(FSDP2, HSDP, expert parallel, a pipeline stage) and then materialised shard by shard holds
exactly the single-process initialisation for the same seed.

Bitwise: every rank draws each whole parameter from the same CPU generator (seeded by the
model's ``init_seed`` and the parameter's name) and keeps a slice, and a slice of a tensor is
its values, so no tolerance is needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe.model import MoETransformer, preset
from moe.parallel import full_state_dict
from moe.parallel.launch import ok_values, run_local
from moe.parallel.materialize import materialize, parameters_on_meta
from moe.parallel.mesh import Layout, ParallelMesh, fsdp_units, mixed_precision, shard_model

SEED = 1234


def cfg(**overrides):
    return preset("tiny", n_layers=3, **overrides)


def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {set(got) ^ set(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, f"{what} {k}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        if not torch.equal(g, w):
            d = (g.double() - w.double()).abs()
            raise AssertionError(f"{what} {k}: max {d.max():.3e} mean {d.mean():.3e}")


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_materialised_on_one_process_equals_the_ordinary_build(tied):
    want = MoETransformer(cfg(tie_embeddings=tied), init_seed=SEED)
    with parameters_on_meta():
        model = MoETransformer(cfg(tie_embeddings=tied), init_seed=SEED)
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    materialize(model, "cpu", model.init_parameter)
    assert (model.head.weight is model.embed.weight) == tied
    assert_same_state(model.state_dict(), want.state_dict(), "materialised")
    for (name, b), wb in zip(model.named_buffers(), want.buffers()):
        assert torch.equal(b, wb), name


def test_materialize_refuses_a_model_already_on_a_device():
    with pytest.raises(ValueError, match="on the meta device; 'embed.weight' is on cpu"):
        materialize(MoETransformer(cfg()), "cpu", lambda name, full: None)


def test_different_seeds_draw_different_weights_and_a_seed_is_reproducible():
    a, b = MoETransformer(cfg(), init_seed=1), MoETransformer(cfg(), init_seed=2)
    assert not torch.equal(a.embed.weight, b.embed.weight)
    torch.manual_seed(5)
    c = MoETransformer(cfg())
    torch.manual_seed(5)
    assert_same_state(MoETransformer(cfg()).state_dict(), c.state_dict(), "same global seed")


def _sharded_worker(rank: int, world: int, layouts: dict) -> dict:
    out = {}
    for name, (replicate, ep) in layouts.items():
        pmesh = ParallelMesh(Layout.from_world(world, replicate, ep))
        with parameters_on_meta():
            model = MoETransformer(cfg(), expert_parallel=pmesh.expert_parallel(), init_seed=SEED)
        shard_model(model, pmesh, fsdp_units(list(model.blocks)), mixed_precision(torch.device("cpu")))
        materialize(model, "cpu", model.init_parameter)
        local = sum(p.to_local().numel() for p in model.parameters())
        out[name] = (full_state_dict(model), local)
        dist.barrier()
    return out


LAYOUTS = {"dp_shard2_ep2": (1, 2)}
SLOW_LAYOUTS = {"dp_shard4": (1, 1), "ep4": (1, 4), "dp_replicate2_ep2": (2, 2)}


@pytest.mark.slow  # 4 spawned processes: about 50 s on 2 loaded cores
@pytest.mark.parametrize("layouts", [LAYOUTS, SLOW_LAYOUTS], ids=["fsdp2xep", "more"])
def test_four_rank_sharded_materialisation_gathers_to_the_single_process_model(layouts):
    want = MoETransformer(cfg(), init_seed=SEED)
    total = sum(p.numel() for p in want.parameters())
    per_rank = ok_values(run_local(_sharded_worker, 4, layouts, timeout_s=300))
    for name in layouts:
        assert_same_state(per_rank[0][name][0], want.state_dict(), name)
        held = max(r[name][1] for r in per_rank)
        if layouts[name][0] == 1:  # no replica: every rank holds about a quarter
            assert held <= 0.3 * total, f"{name}: a rank holds {held} of {total} parameter values"
