"""Byte-level corpora for training and evaluation. No downloads.

Three sources, chosen by one string (``load_corpus(source)``):

* ``"stdlib"`` (the default): the Python standard library's own ``.py`` source files, read
  from the running interpreter's installation (``sysconfig.get_paths()["stdlib"]``, without
  ``site-packages``). Every machine that runs this package has them. Files are concatenated
  in a fixed order (by CRC-32 of their relative path, a deterministic shuffle) up to
  ``max_bytes``, so the corpus is the same on every run of the same Python version.
* ``"canary"``: uniformly random tokens over a small vocabulary, drawn from a fixed seed. No
  model can predict them, so a causal loss below ``log(V)`` nats is impossible; any
  teacher-forced loss below it is information taken from the future.
* a path: a text file, or a directory whose files (recursively, sorted) are concatenated.

The train/validation split is deterministic: the stream is cut into 20 equal segments and the
last ``val_fraction`` of each is validation (see :func:`split`), the rest is training.

Shape legend: B batch, T sequence length, W evaluation windows.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

CANARY_SEED = 20261129
"""Seed of the canary's random token stream (fixed: the canary is the same everywhere)."""


@dataclass
class Corpus:
    """A token stream split into training and validation parts."""

    train: Tensor
    """uint8 [N_train]: training tokens."""
    val: Tensor
    """uint8 [N_val]: validation tokens."""
    vocab_size: int
    """Number of distinct token ids the model must cover (256 for bytes)."""
    source: str
    """Where the tokens came from, for logs."""

    def __post_init__(self) -> None:
        for name in ("train", "val"):
            t = getattr(self, name)
            if t.dim() != 1 or t.dtype != torch.uint8:
                raise ValueError(f"Corpus.{name} must be a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root
    (installed packages under ``site-packages`` / ``dist-packages`` are not part of it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def user_files(path: str | os.PathLike) -> list[Path]:
    """The files named by ``path``: the file itself, or a directory's files (recursive, sorted,
    hidden files and directories skipped). Raises for a missing path or one with no files."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.is_file():
        return [p]
    files = sorted(
        (f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)),
        key=lambda f: f.relative_to(p).as_posix(),
    )
    if not files:
        raise ValueError(f"data directory {str(p)!r} contains no files")
    return files


def read_bytes(files: Sequence[Path], max_bytes: int) -> bytes:
    """Concatenate the files' bytes (each followed by a newline), stopping at ``max_bytes``."""
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes() + b"\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)


def split(tokens: Tensor, val_fraction: float, num_segments: int = 20) -> tuple[Tensor, Tensor]:
    """(train, val): the stream is cut into ``num_segments`` equal segments (fewer for tiny
    corpora) and the last ``val_fraction`` of each is validation, so validation samples the
    whole corpus. Exactly ``floor(N * val_fraction)`` tokens (at least one) are validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = tokens.numel()
    n_val = max(1, math.floor(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"corpus of {n} tokens is too small to split with val_fraction={val_fraction}")
    segments = min(num_segments, n_val)
    is_val = torch.zeros(n, dtype=torch.bool)
    for k in range(segments):
        end = (k + 1) * n // segments
        # Cumulative targets telescope to n_val in total.
        take = (k + 1) * n_val // segments - k * n_val // segments
        is_val[end - take : end] = True
    return tokens[~is_val], tokens[is_val]


def canary_tokens(vocab_size: int, num_tokens: int, seed: int = CANARY_SEED) -> Tensor:
    """uint8 [num_tokens]: i.i.d. uniform tokens in [0, vocab_size), the same for a given seed."""
    if not 2 <= vocab_size <= 256:
        raise ValueError(f"canary vocab_size must be in [2, 256], got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g, dtype=torch.int64).to(torch.uint8)


@functools.lru_cache(maxsize=8)
def _load_cached(source: str, val_fraction: float, max_bytes: int, canary_vocab: int) -> Corpus:
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if source == "canary":
        train, val = split(canary_tokens(canary_vocab, max_bytes), val_fraction)
        return Corpus(train, val, canary_vocab, f"canary (uniform random tokens, V={canary_vocab})")
    if source == "stdlib":
        # A fixed pseudo-random file order, so the first max_bytes sample the whole library.
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib_files(), key=lambda f: zlib.crc32(f.relative_to(root).as_posix().encode()))
        if not files:
            raise ValueError(
                f"no .py files under {sysconfig.get_paths()['stdlib']!r}; this interpreter ships without its "
                "standard library sources: pass a path to your own text instead"
            )
        where = f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)"
    else:
        files = user_files(source)
        where = source
    data = read_bytes(files, max_bytes)
    if not data.strip():
        raise ValueError(f"data source {source!r} is empty")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    train, val = split(tokens, val_fraction)
    return Corpus(train, val, 256, where)


def load_corpus(source: str = "stdlib", val_fraction: float = 0.1, max_bytes: int = 4_000_000, canary_vocab: int = 8) -> Corpus:
    """Load ``"stdlib"``, ``"canary"`` or a path (file or directory) as a byte-level corpus.

    ``max_bytes`` caps the tokens read (for the canary: the number of tokens drawn). Results
    are cached per process: the tensors are shared, treat them as read-only.
    """
    return _load_cached(str(source), float(val_fraction), int(max_bytes), int(canary_vocab))


def batch_offsets(num_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> Tensor:
    """int64 [B]: start offsets of the training windows of ``step``: a pure function of
    (seed, step), so a resumed run draws the same batches and any process can draw any step."""
    if num_tokens < seq_len + 1:
        raise ValueError(f"training split has {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, num_tokens - seq_len, (batch_size,), generator=g)


def windows(tokens: Tensor, offsets_B: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(idx_BT, targets_BT) int64: inputs tokens[o:o+T] and next tokens tokens[o+1:o+T+1]."""
    ar_T1 = torch.arange(seq_len + 1)
    w_BT1 = tokens[offsets_B[:, None] + ar_T1].long()
    return w_BT1[:, :-1], w_BT1[:, 1:]


def eval_offsets(num_tokens: int, seq_len: int, num_windows: int) -> Tensor:
    """int64 [W]: evenly spaced, non-overlapping validation windows (deterministic)."""
    available = (num_tokens - 1) // seq_len
    if available < 1:
        raise ValueError(f"validation split has {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    if num_windows > available:
        raise ValueError(
            f"validation split holds {available} non-overlapping windows of {seq_len} tokens, "
            f"{num_windows} were asked for: lower eval_windows or raise val_fraction"
        )
    slot_W = torch.div(torch.arange(num_windows) * available, num_windows, rounding_mode="floor")
    return slot_W * seq_len
