"""What a run does with the checkpoints already in its ``--checkpoint-dir``: a fresh run refuses a
folder that holds another run's (it never writes over, rotates away or mixes with them), and a
``--metrics-jsonl`` that holds another run's records; a
resumed run refuses a checkpoint of another run (another model, data or seed: the fields named),
keeps the learning-rate schedule it started with, and says in one line what it changes (another
``--steps``, ``--schedule-steps``, ``--lr`` or AdamW setting)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from moe.checks import first_few
from moe.model import ModelConfig
from moe.parallel.sharded_state import load_sharded
from moe.training.checkpoint_files import (
    EXPORT_NAME,
    checkpoint_path,
    complete_checkpoints,
    resumable_checkpoint,
)
from moe.training.config import TrainConfig
from moe.training.optim import OptimizerConfig, lr_at

SAME_RUN = ("seed", "data", "model_config", "hf_model")
"""What makes a checkpoint the same run: the seed, the data section and the model (the resolved
ModelConfig but its data path ``backend``, and a Hugging Face model's name)."""
SAID = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")
"""Optimizer fields a resume may change, each change said in one line (``--steps`` and
``--schedule-steps`` have their own lines, :func:`kept_schedule`)."""


def flag(name: str) -> str:
    return "--router-option" if name == "router_options" else "--" + name.replace("_", "-")


def refuse_foreign(directory: Path | None) -> None:
    """ValueError if a fresh run (no ``--resume``) would write into a folder holding checkpoints
    (or an exported model) it did not write."""
    if directory is None or not directory.is_dir():
        return
    found = sorted(p.name for p in [*directory.glob("step-*"), directory / EXPORT_NAME] if p.exists())
    if found:
        raise ValueError(
            f"--checkpoint-dir {directory} holds another run's checkpoints ({first_few(found)}): add --resume to continue "
            "that run, or use another --checkpoint-dir (a fresh run never writes over them)"
        )


def refuse_foreign_metrics(metrics_jsonl: str | None) -> None:
    """ValueError if a fresh run (no ``--resume``) would empty a metrics JSONL that holds records
    it did not write."""
    if metrics_jsonl and Path(metrics_jsonl).is_file() and Path(metrics_jsonl).stat().st_size:
        raise ValueError(
            f"--metrics-jsonl {metrics_jsonl} holds another run's metrics: add --resume to continue that run, "
            "or use another --metrics-jsonl (a fresh run never writes over them)"
        )


def run_identity(train_config: dict, model_config: dict) -> dict:
    """The fields of :data:`SAME_RUN`, flat (``seed``, ``seq_len``, ``d_model``, ...), from a
    config as ``dataclasses.asdict`` gives it (a checkpoint's ``meta.json`` holds both)."""
    model = {k: v for k, v in model_config.items() if k != "backend"}
    return {
        "seed": train_config.get("seed"),
        "hf_model": train_config.get("model", {}).get("hf_model"),
        **train_config.get("data", {}),
        **model,
    }


def differences(there: dict, here: dict) -> list[str]:
    """``--seed 0 there, 1 here`` for every key whose values differ."""
    return [f"{flag(k)} {there.get(k)!r} there, {here.get(k)!r} here" for k in here if there.get(k) != here.get(k)]


def same_run(meta: dict, cfg: TrainConfig, mcfg: ModelConfig, directory: Path) -> None:
    """ValueError naming the fields that differ if the checkpoint ``meta`` is another run's."""
    there = run_identity(meta.get("train_config", {}), meta["model_config"])
    differ = differences(there, run_identity(dataclasses.asdict(cfg), dataclasses.asdict(mcfg)))
    if differ:
        raise ValueError(
            f"--resume: {directory} holds another run ({'; '.join(differ)}): resume it with its own values, "
            "or start this run in another --checkpoint-dir"
        )


def resume(
    cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, mcfg: ModelConfig
) -> tuple[int, str | None, list[str], TrainConfig]:
    """(steps already taken, wandb run id, what happened in words, the config to run): the last
    complete checkpoint loaded with ``--resume``, else a fresh start (which
    :func:`refuse_foreign` has allowed). A checkpoint past ``steps`` or of another run
    (:func:`same_run`) is refused; the learning-rate schedule is the one the run started with
    unless ``schedule_steps`` says otherwise (:func:`kept_schedule`)."""
    directory = cfg.checkpoint.directory
    if not cfg.checkpoint.resume:
        return 0, None, [], cfg
    found = complete_checkpoints(directory)
    if not found:
        return 0, None, [f"no checkpoint found in {cfg.checkpoint.checkpoint_dir}, starting fresh"], cfg
    path, meta = resumable_checkpoint(found[-1])  # or the newest older one that verifies
    same_run(meta, cfg, mcfg, directory)
    start = int(meta["step"])
    loaded, steps = checkpoint_path(directory, start).name, cfg.optimizer.steps
    if start > steps:
        raise ValueError(
            f"--resume: the last checkpoint, {loaded}, is past --steps {steps}: raise --steps "
            "or use another --checkpoint-dir"
        )
    load_sharded(path, model, optimizer)
    started = OptimizerConfig(**meta["train_config"]["optimizer"])
    apply_hyperparameters(optimizer, cfg.optimizer)  # the flags', not the checkpoint's
    left = f"{steps - start} steps to go" if start < steps else "no steps left: only the final evaluation"
    cfg, note = kept_schedule(cfg, started, start)
    return (
        start,
        meta.get("wandb_run_id"),
        [f"resumed from {loaded} ({left})", *optimizer_changes(started, cfg.optimizer), *note],
        cfg,
    )


def apply_hyperparameters(optimizer: torch.optim.Optimizer, opt: OptimizerConfig) -> None:
    """AdamW's betas and weight decay from ``opt`` (a loaded optimizer state brings the
    checkpoint's): the decayed group is the one with a nonzero decay (``make_optimizer``)."""
    for group in optimizer.param_groups:
        group["betas"] = (opt.beta1, opt.beta2)
        if group["weight_decay"]:
            group["weight_decay"] = opt.weight_decay


def optimizer_changes(started: OptimizerConfig, now: OptimizerConfig) -> list[str]:
    """One line naming the optimizer settings of :data:`SAID` that differ from the run's start."""
    changed = [
        f"{flag(k)} {getattr(now, k)} (was {getattr(started, k)})"
        for k in SAID
        if getattr(now, k) != getattr(started, k)
    ]
    return [f"changed on resume: {', '.join(changed)}"] if changed else []


def kept_schedule(cfg: TrainConfig, started: OptimizerConfig, start: int) -> tuple[TrainConfig, list[str]]:
    """(``cfg`` with the learning-rate schedule a resumed run keeps, a line saying what a changed
    ``--steps`` or ``--schedule-steps`` does to it, if anything). The run started with
    ``started``'s schedule and took ``start`` steps of it; without ``--schedule-steps`` that
    schedule is kept, so a resume with the same flags continues the very run."""
    opt = cfg.optimizer
    if opt.schedule_steps is None:
        opt = dataclasses.replace(opt, schedule_steps=started.schedule)
    cfg = dataclasses.replace(cfg, optimizer=opt)
    final, before = opt.lr * opt.min_lr_ratio, lr_at(start - 1, started)
    if opt.schedule != started.schedule:
        return cfg, [
            f"--schedule-steps {opt.schedule}: the learning-rate schedule changes from the {started.schedule} steps "
            f"the run started with to {opt.schedule}; the rate goes from {before:.2e} at step {start} to "
            f"{lr_at(start, opt):.2e} at step {start + 1}"
        ]
    if opt.steps > opt.schedule:
        return cfg, [
            f"--steps {opt.steps} runs past the {opt.schedule}-step learning-rate schedule the run started with: "
            f"kept, steps {max(start, opt.schedule) + 1}-{opt.steps} at its final rate {final:.2e} "
            f"(--schedule-steps {opt.steps} stretches it instead)"
        ]
    if opt.steps < opt.schedule:
        return cfg, [
            f"--steps {opt.steps} stops inside the {opt.schedule}-step learning-rate schedule the run started with: "
            f"kept, the last rate is {lr_at(opt.steps - 1, opt):.2e}, not its final {final:.2e} "
            f"(--schedule-steps {opt.steps} shortens it instead)"
        ]
    return cfg, []
