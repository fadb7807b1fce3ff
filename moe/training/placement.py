"""A run's model placed once, with the step strategy its config selects (``moe.training.steps``),
in torchtitan's order: the strategy chosen, the layout of the ``[parallel]`` section, the model
built on its mesh (``moe.parallel.placement.build_placement``), cut by the strategy (a pipeline
stage), compiled, checkpointed, sharded and materialised (``shard_placement``), and the strategy
told that placement is done (the pipeline schedule)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from moe.parallel.placement import Placement, build_placement, shard_placement
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo
from moe.training.steps import StepStrategy, choose_strategy


def place_model(
    cfg: TrainConfig, num_experts: int | None, build: Callable[[object], nn.Module], info: DistInfo
) -> tuple[Placement, StepStrategy]:
    """Choose the step strategy of ``cfg``, build the mesh, build the model with
    ``build(expert_parallel)`` (a ``moe.parallel.ExpertParallel`` or None; parameters may be on
    the meta device, then the model provides ``init_parameter(name, full)``), let the strategy
    cut it (a pipeline stage), compile and checkpoint its blocks (in that order), shard it with
    FSDP2 over the stage's data-parallel ranks, materialise this rank's shards (no rank ever
    holds the whole model), make its routers count load-balancing fractions over them and let
    the strategy finish. ``info``: the process's rank, world size and device; ``num_experts``
    (None: the builder checks it) must split over the expert-parallel ranks. Returns the
    placement and its strategy. A collective: every rank calls it."""
    strategy_cls = choose_strategy(cfg)
    par, world = cfg.parallel, info.world_size
    layout = par.layout(world)
    if num_experts is not None:
        layout.check_experts(num_experts)
    strategy_cls.check_world(world)
    options = par.placement_options()
    place = build_placement(layout, options, build, info.device, info.rank, on_mesh=strategy_cls.uses_mesh)
    init_parameter = place.model.init_parameter  # the model as built: a strategy may cut it
    strategy = strategy_cls(place, cfg)
    local = cfg.data.batch_size // place.dp_size
    if local % par.microbatches:
        raise ValueError(
            f"a rank's batch of {local} sequences does not split into microbatches={par.microbatches} equal parts"
        )
    shard_placement(place, options, init_parameter)
    strategy.placed()
    return place, strategy
