"""The checkpoint section of a run: where and how often checkpoints are written, and what a
resume starts from (the file format and its atomic writes are :mod:`moe.training.checkpoint_files`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe.checks import nonnegative_int, positive_int


@dataclass
class CheckpointConfig:
    """Checkpoints of a run."""

    checkpoint_dir: str | None = None
    """Write sharded checkpoints (``step-NNNNNNNN/``, DCP: every rank writes its shards) here,
    atomically, every ``checkpoint_every`` steps and after the last step."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only after the last step)."""
    keep_checkpoints: int = 2
    """K: keep the last K complete checkpoints (older ones are deleted once a finite step has
    followed the newest: a diverging run never rotates a good one away)."""
    export_model: bool = False
    """After the last step also write ``checkpoint_dir/model.pt``, the consolidated single-process
    state dict (every rank gathers the whole model: for small models)."""
    export_hf: bool = False
    """After the last step also write ``checkpoint_dir/hf/``, the exported model as a Hugging Face
    checkpoint folder (``moe.integrations.hf.export_pretrained``; the ``[hf]`` extra), and
    ``model.pt`` with it."""
    resume: bool = False
    """Continue from the last complete checkpoint in ``checkpoint_dir`` if there is one (written on
    any layout or number of processes, by the same run: seed, data and model); start afresh if
    there is none (so a run restarted by ``torchrun --max-restarts`` resumes). Without it, a
    folder that holds checkpoints is refused."""

    def __post_init__(self) -> None:
        nonnegative_int("checkpoint_every", self.checkpoint_every)
        positive_int("keep_checkpoints", self.keep_checkpoints)
        if (self.resume or self.export_model or self.export_hf) and not self.checkpoint_dir:
            raise ValueError("resume, export_model and export_hf need checkpoint_dir")

    @property
    def directory(self) -> Path | None:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else None

    def due(self, step: int, last_step: int) -> bool:
        """Whether a checkpoint is written after ``step``."""
        if self.directory is None:
            return False
        return step == last_step or bool(self.checkpoint_every and step % self.checkpoint_every == 0)
