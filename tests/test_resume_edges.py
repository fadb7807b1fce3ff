"""What ``--resume`` and the checkpoint section decide, at their edges: a checkpoint at exactly
``--steps``, the schedule kept or changed (with the rates it says, worked out from the cosine
formula by hand), the optimizer settings it applies and names, what counts as the same run,
and the settings a checkpoint section refuses.
"""

import dataclasses
import math

import pytest
import torch
from helpers import SMALL_RUN

from moe.model import ModelConfig
from moe.training import TrainConfig, train
from moe.training.checkpoint_config import CheckpointConfig
from moe.training.optim import OptimizerConfig
from moe.training.resume import (
    apply_hyperparameters,
    kept_schedule,
    optimizer_changes,
    refuse_foreign_metrics,
    same_run,
)


def cosine(step: int, lr: float, schedule: int) -> float:
    """No warmup, min_lr_ratio 0: lr * (1 + cos(pi * step / (schedule - 1))) / 2, 0-based steps."""
    return lr * 0.5 * (1 + math.cos(math.pi * step / (schedule - 1)))


def test_a_checkpoint_at_exactly_steps_resumes_with_no_step_left(tmp_path, capsys):
    common = dict(SMALL_RUN, steps=2, eval_windows=1, log_every=1, checkpoint_dir=str(tmp_path / "run"))
    train(TrainConfig.flat(**common))
    capsys.readouterr()
    result = train(TrainConfig.flat(**common, resume=True))
    assert "resumed from step-00000002 (no steps left: only the final evaluation)" in capsys.readouterr().out
    assert result.history == [] and math.isfinite(result.final_eval["causal_loss"])


def test_the_same_steps_keep_the_schedule_and_say_nothing():
    started = OptimizerConfig(steps=10, warmup_steps=0)
    cfg = TrainConfig.flat(steps=10, warmup_steps=0)
    kept, said = kept_schedule(cfg, started, 4)
    assert said == [] and kept.optimizer.schedule == 10


def test_a_changed_schedule_says_the_rates_either_side_of_the_resume():
    """Resumed after 5 steps of a 10-step schedule into a 20-step one: the rate of step 5 (the
    last taken, 0-based 4) of the old schedule, then that of step 6 (0-based 5) of the new."""
    started = OptimizerConfig(steps=10, lr=1.0, warmup_steps=0, min_lr_ratio=0.0)
    cfg = TrainConfig.flat(steps=20, schedule_steps=20, lr=1.0, warmup_steps=0, min_lr_ratio=0.0)
    _, [line] = kept_schedule(cfg, started, 5)
    before, after = cosine(4, 1.0, 10), cosine(5, 1.0, 20)
    assert f"the rate goes from {before:.2e} at step 5 to {after:.2e} at step 6" in line, line


@pytest.mark.parametrize(
    "field, value, flag", [("grad_clip", 0.5, "--grad-clip"), ("beta2", 0.9, "--beta2"), ("lr", 1e-4, "--lr")]
)
def test_every_changed_optimizer_setting_is_named(field, value, flag):
    started = OptimizerConfig(steps=10)
    now = dataclasses.replace(started, **{field: value})
    assert optimizer_changes(started, started) == []
    [line] = optimizer_changes(started, now)
    assert line.startswith("changed on resume: ") and f"{flag} {value} (was {getattr(started, field)})" in line


def test_resume_applies_the_flags_betas_and_weight_decay_to_a_loaded_optimizer():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], betas=(0.9, 0.95)
    )
    apply_hyperparameters(opt, OptimizerConfig(steps=1, beta1=0.8, beta2=0.99, weight_decay=0.3))
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.8, 0.99)]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]


def test_the_data_path_backend_is_not_part_of_the_run_but_the_seed_is(tmp_path):
    cfg, mcfg = TrainConfig.flat(seed=3), ModelConfig(backend="torch")
    meta = {"train_config": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(mcfg)}
    same_run({**meta, "model_config": {**meta["model_config"], "backend": "triton"}}, cfg, mcfg, tmp_path)
    with pytest.raises(ValueError, match="--seed 3 there, 4 here"):
        same_run(meta, dataclasses.replace(cfg, seed=4), mcfg, tmp_path)


def test_an_empty_metrics_file_is_not_another_runs(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("")
    refuse_foreign_metrics(str(path))
    path.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="holds another run's metrics"):
        refuse_foreign_metrics(str(path))


def test_the_checkpoint_section_refuses_keeping_none_and_exports_without_a_folder():
    with pytest.raises(ValueError, match="keep_checkpoints"):
        CheckpointConfig(checkpoint_dir="d", keep_checkpoints=0)
    for flag in ("resume", "export_model", "export_hf"):
        with pytest.raises(ValueError, match="need checkpoint_dir"):
            CheckpointConfig(**{flag: True})
