"""Pipeline parallelism as a step strategy: this rank keeps its stage of the model
(``moe.parallel.pipeline``), the schedule runs every microbatch's forward and backward, the
tied embedding's two copies share their gradients, and evaluation runs through the stages."""

from __future__ import annotations

import torch
from torch import Tensor

from moe.eval import autocast
from moe.parallel.pipeline import Pipeline, StageModel, sync_tied_gradient, tied_groups, virtual_stages
from moe.parallel.pipelined_lm import PipelinedLM
from moe.parallel.placement import Placement
from moe.training.config import TrainConfig
from moe.training.metrics import StepTally
from moe.training.steps.base import StepStrategy, register_strategy


@register_strategy
class Pipelined(StepStrategy):
    """``parallel.pipeline_parallel`` > 1: the blocks cut into stages, scheduled by
    ``parallel.pipeline_schedule`` over ``parallel.microbatches`` microbatches."""

    name = "pipelined"

    @staticmethod
    def selected(cfg: TrainConfig) -> bool:
        return cfg.parallel.pipeline_parallel > 1

    def __init__(self, place: Placement, cfg: TrainConfig) -> None:
        super().__init__(place, cfg)
        layout, pmesh = place.layout, place.mesh
        virtual = virtual_stages(cfg.parallel.pipeline_schedule)
        if virtual > 1 and layout.data_parallel > 1:
            raise ValueError(
                "interleaved1f1b runs without data parallelism inside a stage here: use "
                "--pipeline-schedule gpipe or 1f1b, or as many processes as pipeline stages"
            )
        pp_rank, place.dp_rank = pmesh.coordinate()
        place.dp_size, place.dp_group, place.pp_group = layout.data_parallel, pmesh.dp_group, pmesh.pp_group
        place.stage = place.model = StageModel(place.model, pp_rank, layout.pipeline, virtual)
        if place.stage.cfg.tie_embeddings:
            place.tied_group = tied_groups(layout.pipeline, layout.data_parallel, pmesh.global_rank)[place.dp_rank]

    def placed(self) -> None:
        place, par = self.place, self.cfg.parallel
        local = self.cfg.data.batch_size // place.dp_size
        logits_dtype = torch.bfloat16 if place.device.type == "cuda" else torch.float32  # autocast's
        place.pipe = Pipeline(
            place.stage,
            par.pipeline_schedule,
            par.microbatches,
            (local // par.microbatches, self.cfg.data.seq_len),
            place.pp_group,
            place.device,
            logits_dtype,
        )
        place.eval_model = PipelinedLM(place.stage, place.pp_group)

    def gradients(self, idx_BT: Tensor, targets_BT: Tensor, tally: StepTally) -> None:
        place = self.place
        with autocast(place.device):
            for loss_m in place.pipe.step(idx_BT, targets_BT):
                tally.add_loss(loss_m)
        tally.add_microbatches(self.cfg.parallel.microbatches)
        for rec in place.stage.pop_records():
            tally.add_routing(
                rec.layer, rec.aux_loss, rec.dropped_fraction, rec.tokens_per_expert, rec.experts_per_token_histogram
            )
        sync_tied_gradient(place.stage.tied_weight(), place.tied_group)
