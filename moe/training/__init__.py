"""The training loop used by the experiments, one job per file:

- ``config``: :class:`TrainConfig`, every field of a run, validated;
- ``distributed``: process-group setup from torchrun's environment, router-state sync;
- ``loop``: model construction, batches, the optimiser schedule and :func:`train`;
- ``placement``: this rank's part of the model (pipeline stage, FSDP2) and its process groups;
- ``pipeline``: pipeline stages, aux-loss injection and the schedules;
- ``pipelined_lm``: the model's forward, KV cache and decoding through the stages (evaluation);
- ``metrics``: per-step metrics and the wandb run;
- ``checkpoint``: atomic checkpoints and exact resume;
- ``cli``: the command line generated from the config dataclasses.

Evaluation lives in :mod:`moe.eval`, importable without the loop.
"""

from moe.training.cli import config_from_args, main
from moe.training.config import TrainConfig
from moe.training.loop import TrainResult, build_model, lr_at, model_config, train

__all__ = ["TrainConfig", "TrainResult", "build_model", "config_from_args", "lr_at", "main", "model_config", "train"]
