"""Byte-level corpora (vocabulary 256), the embedded default. No downloads.

Three sources, chosen by one string (``moe.data.load_corpus(source)``):

* ``"stdlib"`` (the default): the Python standard library's own ``.py`` source files, read
  from the running interpreter's installation (``sysconfig.get_paths()["stdlib"]``, without
  ``site-packages``). Every machine that runs this package has them. Files are concatenated
  in a fixed order (by CRC-32 of their relative path, a deterministic shuffle) up to
  ``max_bytes``, so the corpus is the same on every run of the same Python version.
* ``"canary"``: uniformly random tokens over a small vocabulary, drawn from a fixed seed. No
  model can predict them, so a causal loss below ``log(V)`` nats is impossible; any
  teacher-forced loss below it is information taken from the future.
* a path: a text file, or a directory whose text files (recursively, sorted; caches and files
  that are not text skipped, ``moe.data.files``) are concatenated.

The stream is loaded whole (``max_bytes``, 4 MB by default) and split by
``moe.data.corpus.split``. A corpus cut by ``max_bytes`` says so in its ``source`` (how much of
how much was read, and the ``max_bytes`` that takes all of it), as does a folder whose files
were skipped.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from moe.data.corpus import Corpus, split
from moe.data.files import select_files

CANARY_SEED = 20261129
"""Seed of the canary's random token stream (fixed: the canary is the same everywhere)."""


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


def canary_tokens(vocab_size: int, num_tokens: int, seed: int = CANARY_SEED) -> Tensor:
    """uint8 [num_tokens]: i.i.d. uniform tokens in [0, vocab_size), the same for a given seed."""
    if not 2 <= vocab_size <= 256:
        raise ValueError(f"canary vocab_size must be in [2, 256], got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g, dtype=torch.int64).to(torch.uint8)


def load_bytes(source: str, val_fraction: float, max_bytes: int, canary_vocab: int) -> Corpus:
    """``"stdlib"``, ``"canary"`` or a text path as a byte corpus (``max_bytes``: tokens read, or drawn)."""
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
        selection = select_files(source)
        files, skipped = selection.files, selection.skipped()
        where = f"{source} ({len(files)} files{'; ' + skipped if skipped else ''})"
    data = read_bytes(files, max_bytes)
    if not data.strip():
        raise ValueError(f"data source {source!r} is empty")
    available = sum(f.stat().st_size + 1 for f in files)  # + the newline after each file
    if len(data) < available:
        where += (
            f"; the first {len(data):,} of {available:,} bytes (max_bytes={max_bytes:,}: "
            f"--max-bytes {available} takes all)"
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    train, val = split(tokens, val_fraction)
    return Corpus(train, val, 256, where)
