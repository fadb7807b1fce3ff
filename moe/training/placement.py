"""Where one rank's part of the model lives: its pipeline stage (``moe.training.pipeline``), its
FSDP2 sharding over the stage's data-parallel ranks (``moe.parallel.mesh``), and the process
groups its training step needs. The model arrives built whole (experts already cut for expert
parallelism) and leaves placed."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.parallel import share_router_statistics
from moe.parallel.mesh import Layout, ParallelMesh, mixed_precision, shard_model
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo
from moe.training.pipeline import Pipeline, StageModel, tied_groups, virtual_stages
from moe.training.pipelined_lm import PipelinedLM


@dataclass
class Placement:
    """This rank's model and the groups of its step."""

    model: nn.Module
    """What this rank trains: the whole model (FSDP2-sharded when sharded) or its pipeline stage."""
    eval_model: nn.Module
    """What evaluation calls: ``model``, or a :class:`PipelinedLM` over the stages."""
    dp_rank: int
    """This rank's index among the data-parallel ranks that split the batch."""
    dp_size: int
    dp_group: object
    """The data-parallel ranks holding the same parameters (None on one process)."""
    sharded: bool
    """FSDP2 reduces the gradients (more than one data-parallel rank on a mesh)."""
    stage: StageModel | None = None
    pipe: Pipeline | None = None
    pp_group: object = None
    """The pipeline ranks of this rank's data-parallel index (None without a pipeline)."""
    tied_group: object = None
    """The first and last pipeline rank, whose copies of a tied embedding share gradients."""

    def uncounted(self) -> tuple:
        """Parameters the gradient norm must not count twice (the last stage's tied head)."""
        return self.stage.uncounted() if self.stage is not None else ()


def place_model(model: nn.Module, cfg: TrainConfig, info: DistInfo, layout: Layout,
                pmesh: ParallelMesh | None) -> Placement:
    """Cut ``model`` to this rank's pipeline stage, shard it with FSDP2 over the stage's
    data-parallel ranks, make its routers count load-balancing fractions over them, and build
    the pipeline schedule (collectives: every rank calls this)."""
    world = info.world_size
    place = Placement(model, model, info.rank, world, dist.group.WORLD if world > 1 else None,
                      sharded=pmesh is not None and layout.data_parallel > 1)
    if layout.pipeline > 1:
        virtual = virtual_stages(cfg.pipeline_schedule)
        if virtual > 1 and layout.data_parallel > 1:
            raise ValueError("interleaved1f1b runs without data parallelism inside a stage here: use "
                             "--pipeline-schedule gpipe or 1f1b, or as many processes as pipeline stages")
        pp_rank, place.dp_rank = pmesh.coordinate()
        place.dp_size, place.dp_group, place.pp_group = layout.data_parallel, pmesh.dp_group, pmesh.pp_group
        place.stage = place.model = StageModel(model, pp_rank, layout.pipeline, virtual)
        if model.cfg.tie_embeddings:
            place.tied_group = tied_groups(layout.pipeline, layout.data_parallel, pmesh.global_rank)[place.dp_rank]
    local = cfg.batch_size // place.dp_size
    if local % cfg.microbatches:
        raise ValueError(f"a rank's batch of {local} sequences does not split into microbatches={cfg.microbatches} "
                         "equal parts")
    if place.sharded:
        # Blocks return views (reshapes); nothing here modifies a block's output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        blocks = place.model.blocks
        units = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
        shard_model(place.model, pmesh, units, mixed_precision(info.device, torch.float32))
    if place.dp_size > 1:
        share_router_statistics(place.model, place.dp_group)
    if place.stage is not None:
        logits_dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32  # autocast's
        place.pipe = Pipeline(place.stage, cfg.pipeline_schedule, cfg.microbatches,
                              (local // cfg.microbatches, cfg.seq_len), place.pp_group, info.device, logits_dtype)
        place.eval_model = PipelinedLM(place.stage, place.pp_group)
    return place
