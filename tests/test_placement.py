"""``moe.parallel`` places a model from what the placement needs (a Layout and PlacementOptions),
never a run's config; the trainer's flat ``[parallel]`` section maps onto those two types."""

import re

import pytest
import torch
from test_codebase import import_graph

from moe.model import MoETransformer, preset
from moe.parallel.materialize import parameters_on_meta
from moe.parallel.mesh import Layout
from moe.parallel.placement import PlacementOptions, build_placement, shard_placement
from moe.parallel.recompute import SELECTIVE_COMPILED_REFUSAL, checkpoint_mode
from moe.training import TrainConfig


def test_moe_parallel_imports_nothing_from_the_trainer():
    graph = import_graph()
    upward = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.startswith("moe.parallel")
        for t in ts
        if t.startswith("moe.training")
    )
    assert not upward, upward
    assert "moe.parallel.placement" in graph["moe.training.placement"]  # and the trainer places through it


def test_the_parallel_section_maps_onto_a_layout_and_placement_options():
    given = dict(compile=True, activation_checkpointing="full", expert_exchange="dedup", grad_reduce_dtype="bf16")
    par = TrainConfig.flat(dp_replicate=2, expert_parallel=2, **given).parallel
    assert par.layout(8) == Layout(dp_replicate=2, dp_shard=2, expert_parallel=2, pipeline=1)
    assert par.placement_options() == PlacementOptions(**given)
    assert TrainConfig().parallel.placement_options() == PlacementOptions()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(expert_exchange="twice"), "expert_exchange must be one of per_assignment, dedup"),
        (dict(grad_reduce_dtype="fp8"), r"grad_reduce_dtype must be one of \['bf16', 'fp32'\]"),
        (dict(activation_checkpointing="some"), "activation_checkpointing must be one of"),
        (dict(compile=True, activation_checkpointing="selective"), re.escape(SELECTIVE_COMPILED_REFUSAL)),
    ],
)
def test_placement_options_and_the_section_refuse_the_same_values(options, message):
    with pytest.raises(ValueError, match=message):
        PlacementOptions(**options)
    with pytest.raises(ValueError, match=message):
        TrainConfig.flat(**options)


def test_one_process_placement_equals_the_model_built_whole():
    """Built on the meta device, placed (blocks recomputed) and filled: the single-process
    model of the same seed, bitwise, its blocks checkpointed as asked."""

    def build(expert_parallel):
        assert expert_parallel is None  # one process: no mesh
        with parameters_on_meta():
            return MoETransformer(preset("tiny"), init_seed=3)

    layout, options = Layout.from_world(1), PlacementOptions(activation_checkpointing="full")
    place = build_placement(layout, options, build, torch.device("cpu"), rank=0)
    assert place.mesh is None and not place.sharded and (place.dp_rank, place.dp_size) == (0, 1)
    shard_placement(place, options, place.model.init_parameter)
    assert all(checkpoint_mode(b) == "full" for b in place.model.blocks)
    reference = MoETransformer(preset("tiny"), init_seed=3).state_dict()
    placed = place.model.state_dict()
    assert placed.keys() == reference.keys()
    assert all(torch.equal(placed[k], reference[k]) for k in reference)
