"""TrainConfig: one training run's configuration, in sections owned by the modules they
configure, validated on construction, loadable from TOML (or JSON, such as the resolved config a
run records beside its metrics).

    [model]            moe.training.build.ModelSection       preset, router, overrides, hf_model
    [data]             moe.training.batches.DataConfig        corpus, seq_len, batch_size
    [optimizer]        moe.training.optim.OptimizerConfig     steps, lr schedule, AdamW, clipping
    [eval]             moe.eval.EvalConfig                    evaluation cadence and windows
    [parallel]         moe.training.parallel_config.ParallelConfig  mesh layout, pipeline, microbatches
    [lossy]            moe.training.parallel_config.LossyConfig     simulated packet loss
    [checkpoint]       moe.training.checkpoint_config.CheckpointConfig
    [logging]          moe.training.metrics.LoggingConfig     log lines, metrics JSONL, wandb

Each section validates its own fields; :meth:`TrainConfig.__post_init__` holds every rule that
spans sections (which features exclude each other). On the command line every field is a flag
named after the field alone (``--seq-len``, ``--d-model``): see ``moe.training.cli``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from moe.checks import nonnegative_int

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from moe.eval import EvalConfig
from moe.training.batches import DataConfig
from moe.training.build import ModelSection
from moe.training.checkpoint_config import CheckpointConfig
from moe.training.metrics import LoggingConfig
from moe.training.optim import OptimizerConfig
from moe.training.parallel_config import LossyConfig, ParallelConfig

RECORD_KEYS = ("model_config", "invocations")
"""Keys of a run's recorded config (``<metrics>.config.json``, ``moe.training.report``) beside
the TrainConfig fields: what the run resolved and did, not settings; :meth:`TrainConfig.load`
skips them."""


@dataclass
class TrainConfig:
    """Everything one training run needs; validated on construction."""

    model: ModelSection = field(default_factory=ModelSection)
    """The model: preset, router, overrides (or a Hugging Face model)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and the batches."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Steps, learning-rate schedule, AdamW, clipping."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during and after training."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Processes, devices, mesh layout and microbatches."""
    lossy: LossyConfig = field(default_factory=LossyConfig)
    """Data parallelism over a simulated lossy transport."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log lines, metrics JSONL and wandb."""
    seed: int = 0
    """Seeds the model initialisation and the batches (batch of step s is a function of (seed, s))."""

    def __post_init__(self) -> None:
        nonnegative_int("seed", self.seed)
        m, par, lossy = self.model, self.parallel, self.lossy
        if not m.hf_model and self.data.seq_len > m.max_seq_len():
            raise ValueError(
                f"seq_len={self.data.seq_len} exceeds the {m.preset} preset's max_seq_len="
                f"{m.max_seq_len()}: use a shorter --seq-len or raise --max-seq-len"
            )
        if self.eval.causal_stride > self.data.seq_len:
            raise ValueError(f"causal_stride={self.eval.causal_stride} exceeds seq_len={self.data.seq_len}")
        if lossy.packet_loss > 0 and (par.expert_parallel > 1 or m.hf_model or par.grad_reduce_dtype != "fp32"):
            raise ValueError(
                "packet_loss replicates every parameter over plain data parallelism: "
                "no expert_parallel, hf_model or grad_reduce_dtype with it"
            )
        if par.pipeline_parallel > 1 and (lossy.packet_loss > 0 or m.hf_model):
            raise ValueError(
                "pipeline_parallel runs the preset model over a reliable network: no packet_loss or hf_model"
            )
        if par.pipeline_parallel > 1 and par.microbatches > 1 and m.router_options.get("global_aux_loss_coef", 0) > 0:
            raise ValueError(
                "global_aux_loss_coef over several microbatches counts the whole batch in a forward first, which "
                "pipeline_parallel does not run: use microbatches=1 or no pipeline"
            )
        if par.pipeline_parallel > 1 and (m.router == "hash" or m.given().get("hash_layers")):
            raise ValueError(
                "hash routing reads the token ids, which pipeline stages do not pass: no pipeline_parallel"
            )
        if self.data.batch_size % par.microbatches:
            raise ValueError(f"batch_size={self.data.batch_size} is not divisible by microbatches={par.microbatches}")

    @classmethod
    def flat(cls, **values) -> TrainConfig:
        """A config from flat field names, the command line's (``TrainConfig.flat(steps=40,
        seq_len=32, model={"d_model": 32})``: ``model`` is the dict of ModelConfig overrides)."""
        types = _section_types(cls)
        sections: dict[str, dict] = {name: {} for name in types}
        owner = {name: section for section, cls_ in types.items() for name in _field_names(cls_)}
        top = {}
        for name, value in values.items():
            if name == "model":
                sections["model"]["overrides"] = value
            elif name in owner:
                sections[owner[name]][name] = value
            elif name in _field_names(cls):
                top[name] = value
            else:
                raise ValueError(f"unknown TrainConfig field {name!r}")
        return cls(**{s: types[s](**kw) for s, kw in sections.items()}, **top)

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """A config from a TOML file (``[optimizer]\\nsteps = 40``), or a JSON one: the same
        sections, or a run's recorded config (``moe.training.report.record_config``; its
        :data:`RECORD_KEYS` skipped)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} not found")
        text = path.read_text()
        try:
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"config file {str(path)!r} does not parse: {e}") from e
        if path.suffix == ".json" and isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in RECORD_KEYS}
        return from_dict(cls, data, str(path))


def _section_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def from_dict(cls: type, data: dict, where: str = "config"):
    """``cls`` (a dataclass) from nested dicts, sections recursively; unknown keys refused."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = _field_names(cls)
    bad = set(data) - known
    if bad:
        raise ValueError(f"{where}: unknown keys {sorted(bad)} in {cls.__name__}; known: {sorted(known)}")
    values = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = from_dict(hint, value, f"{where} [{name}]")
        values[name] = value
    return cls(**values)
