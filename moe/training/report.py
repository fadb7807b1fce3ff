"""What a run tells its user, on rank 0: the banner, a log line every ``log_every`` steps, the
progress bar, one JSON record per step in the metrics JSONL (with the run's resolved config
recorded beside it, :func:`record_config`), and the wandb run."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from moe.eval import format_difference
from moe.extras import require
from moe.model import ModelConfig
from moe.training.checkpoint_files import truncate_jsonl
from moe.training.config import TrainConfig
from moe.training.distributed import DistInfo
from moe.training.guards import WriteFailed, write_failure
from moe.training.metrics import resolve_wandb_mode, wandb_flat


def config_path(jsonl: Path) -> Path:
    """Where the resolved config of the run writing ``jsonl`` goes: ``<stem>.config.json`` beside it."""
    return jsonl.with_name(f"{jsonl.stem}.config.json")


def record_config(path: Path, cfg: TrainConfig, mcfg, start: int, world_size: int) -> None:
    """Write the run's config to ``path``: every TrainConfig field resolved (defaults included:
    what ``--config`` reads back), ``model_config`` (the ModelConfig the preset, the overrides
    and the data resolved to) and ``invocations``: one entry per invocation of the run, oldest
    first, each with its start step, world size, time and full config. A resumed invocation
    (``start`` > 0) appends to the file's list; a fresh start begins a new one."""
    previous = json.loads(path.read_text()).get("invocations", []) if start and path.is_file() else []
    config, model = dataclasses.asdict(cfg), dataclasses.asdict(mcfg)
    invocation = {
        "started_at_step": start,
        "world_size": world_size,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "model_config": model,
    }
    path.write_text(
        json.dumps({**config, "model_config": model, "invocations": [*previous, invocation]}, indent=2) + "\n"
    )


def init_wandb(cfg: TrainConfig, mcfg: ModelConfig, info: DistInfo, run_id: str | None = None):
    """A wandb run on rank 0 (None elsewhere, and in disabled mode, where wandb is not imported).
    ``run_id`` (saved in checkpoints) makes a resumed run continue the same wandb run."""
    log = cfg.logging
    jsonl_dir = str(Path(log.metrics_jsonl).parent) if log.metrics_jsonl else None
    own_dir = log.wandb_dir or cfg.checkpoint.checkpoint_dir or jsonl_dir
    mode = resolve_wandb_mode(log.wandb_mode, own_dir)
    if not info.is_main or mode == "disabled":
        return None
    asked_by = "--wandb-mode" if log.wandb_mode else "$WANDB_MODE"  # unasked, a missing wandb is disabled
    wandb = require("wandb", "wandb", f"{asked_by} {mode}")
    run_dir = Path(own_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg), "world_size": info.world_size}
    return wandb.init(
        project=log.wandb_project,
        name=log.wandb_run_name,
        config=config,
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True),
    )


class RunReport:
    """Rank 0's outputs of one run (every method is a no-op elsewhere)."""

    def __init__(self, cfg, mcfg, info, start: int, run_id: str | None) -> None:
        self.cfg, self.log = cfg, cfg.logging
        self.main = info.is_main
        self.jsonl = Path(self.log.metrics_jsonl) if self.log.metrics_jsonl and self.main else None
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            if start:
                truncate_jsonl(self.jsonl, start)
            else:
                self.jsonl.write_text("")
            record_config(config_path(self.jsonl), cfg, mcfg, start, info.world_size)
        self.run = init_wandb(cfg, mcfg, info, run_id)
        self.history: list[dict] = []
        self.bar = tqdm(
            initial=start,
            total=cfg.optimizer.steps,
            desc=f"train {cfg.model.router}",
            disable=not (self.main and self.log.progress),
            dynamic_ncols=True,
        )

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def say(self, line: str) -> None:
        """A line for the user (rank 0, unless logging is off)."""
        if line and self.main and self.log.log_every:
            tqdm.write(line)

    def warn(self, line: str) -> None:
        """A warning for the user (rank 0, on stderr, whatever ``log_every`` says)."""
        if self.main:
            tqdm.write(f"warning: {line}", file=sys.stderr)

    def banner(self, corpus, num_params: int, layout=None, architecture: str | None = None) -> None:
        """What is trained on what: the model (a transformers ``architecture`` named, from which
        ``--hf-model``), the whole model's parameter count (not a rank's shard) and, on more than
        one process, the mesh layout."""
        where = f"; mesh {layout}" if layout is not None else ""
        which = f"transformers {architecture} ({self.cfg.model.hf_model}), " if architecture else ""
        self.say(
            f"data: {corpus.source}; {corpus.train.numel():,} train / {corpus.val.numel():,} val tokens; "
            f"model: {which}{num_params:,} parameters, router {self.cfg.model.router} {self.cfg.model.router_options}"
            f"{where}"
        )

    def step(self, record: dict) -> None:
        """The record of one finished step: history, JSONL, wandb, progress bar, log line."""
        if not self.main:
            return
        self.history.append(record)
        if self.jsonl is not None:
            try:
                with self.jsonl.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                raise WriteFailed(
                    f"step {record['step']}: could not write --metrics-jsonl {self.jsonl}: "
                    f"{write_failure(e, self.jsonl.parent)}: free space and --resume"
                ) from None
        if self.run is not None:
            self.run.log(wandb_flat(record), step=record["step"])
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        self.bar.update()
        step, every = record["step"], self.log.log_every
        if every and (step % every == 0 or step == self.cfg.optimizer.steps or "eval/causal_loss" in record):
            self.say(log_line(record))  # every evaluation's result is printed

    def interrupted(self) -> None:
        """Ctrl-C stopped the run: the progress bar ends its line, the wandb run ends as failed."""
        self.bar.close()
        if self.run is not None:
            self.run.finish(exit_code=130)

    def close(self, final_eval: dict) -> None:
        self.bar.close()
        if self.run is not None:
            self.run.summary.update({f"final/{k}": v for k, v in final_eval.items()})
            offline, run_dir = self.run.settings.mode == "offline", Path(self.run.dir).parent
            self.run.finish()
            if offline:
                self.say(f"wandb: offline run written to {run_dir} (upload with: wandb sync {run_dir})")


def log_line(record: dict) -> str:
    """The dense one-line summary of a step's record."""
    line = (
        f"step {record['step']:5d} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f} | "
        f"lr {record['lr']:.2e} | dropped {record['dropped_fraction']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"peak {record['peak_memory_mib']:,.0f} MiB"
    )
    if "eval/causal_loss" in record:
        line += (
            f" | eval tf {record['eval/teacher_forced_loss']:.4f} causal "
            f"{record['eval/causal_loss']:.4f} gap {format_difference(record['eval/leakage_gap'])}"
        )
        if "eval/time_s" in record:
            line += f" ({record['eval/time_s']:.1f} s)"
    return line
