"""The training loop used by the experiments, one job per file:

- ``config``: :class:`TrainConfig`, a run's configuration in sections (TOML in, JSON out);
- ``build``: the model section, the resolved ModelConfig and the model;
- ``batches``: the data section and each rank's batch of each step;
- ``optim``: the optimizer section, AdamW and the learning-rate schedule;
- ``parallel_config``: the parallel and lossy sections (the layout and placement options they give ``moe.parallel``);
- ``checkpoint_config``: the checkpoint section (where, how often, resume);
- ``checkpoint_files``: atomic sharded checkpoints and exact resume, the exported model and its loader;
- ``resume``: what a run does with the checkpoints in its folder (refuse another run's, keep the schedule);
- ``guards``: what stops a run in one line (non-finite numbers, unwritable folders, a full disk);
- ``metrics``: the logging section, per-step metrics and the wandb run;
- ``report``: what rank 0 prints and writes each step;
- ``distributed``: process-group setup from torchrun's environment, router-state sync;
- ``steps``: the step strategies (plain, pipelined, lossy data parallel), one file each;
- ``placement``: the run's model placed once, with the step strategy its config selects;
- ``loop``: :func:`train`: a short core over that step strategy;
- ``cli``: the command line generated from the config by tyro.

Evaluation lives in :mod:`moe.eval`, importable without the loop; the mesh, pipeline stages
and the placement's typed parts in :mod:`moe.parallel`.
"""

from moe.extras import require

# A core install without the [train] extra: one line naming the extra, not tyro's import error.
require("tyro", "train", "the trainer (moe.training, experiments/train.py)")

from moe.training.build import build_model, model_config  # noqa: E402
from moe.training.checkpoint_files import load_export  # noqa: E402
from moe.training.cli import config_from_args, main  # noqa: E402
from moe.training.config import TrainConfig  # noqa: E402
from moe.training.loop import TrainResult, train  # noqa: E402
from moe.training.optim import lr_at  # noqa: E402

__all__ = [
    "TrainConfig",
    "TrainResult",
    "build_model",
    "config_from_args",
    "load_export",
    "lr_at",
    "main",
    "model_config",
    "train",
]
