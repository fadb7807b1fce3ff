"""Corpora for training and evaluation. No downloads.

``load_corpus(source)`` takes one string:

* ``"stdlib"`` (the default), ``"canary"`` or a text path: byte-level corpora (vocabulary
  256) loaded whole, ``max_bytes`` of them (``moe.data.byte_corpora``; which files of a folder
  are text: ``moe.data.files``);
* a prepared directory (holding ``manifest.json``, written by ``python -m moe.data prepare``):
  tokenized shards read through memory maps, never loaded whole, the vocabulary and the
  tokenizer taken from the manifest (``moe.data.shards``; ``max_bytes`` does not apply). A
  directory holding shard files or a ``tokenizer.json`` but no manifest is refused.

Either way the split is deterministic (``moe.data.corpus.split_ranges``) and batches are a
pure function of (seed, step) (``moe.data.batches``).
"""

from __future__ import annotations

import functools

from moe.data.batches import batch_offsets, eval_offsets, windows
from moe.data.byte_corpora import (
    CANARY_SEED,
    canary_tokens,
    load_bytes,
    read_bytes,
    stdlib_files,
)
from moe.data.corpus import Corpus, TokenSource, split, split_ranges
from moe.data.files import FileSelection, is_text, select_files
from moe.data.shards import TokenShards, is_prepared, load_prepared, refuse_without_manifest

__all__ = [
    "CANARY_SEED",
    "Corpus",
    "FileSelection",
    "TokenShards",
    "TokenSource",
    "batch_offsets",
    "canary_tokens",
    "eval_offsets",
    "is_prepared",
    "is_text",
    "load_corpus",
    "load_prepared",
    "read_bytes",
    "select_files",
    "split",
    "split_ranges",
    "stdlib_files",
    "windows",
]


@functools.lru_cache(maxsize=8)
def _load_cached(source: str, val_fraction: float, max_bytes: int, canary_vocab: int) -> Corpus:
    if source not in ("stdlib", "canary"):
        if is_prepared(source):
            return load_prepared(source, val_fraction)
        refuse_without_manifest(source)
    return load_bytes(source, val_fraction, max_bytes, canary_vocab)


def load_corpus(
    source: str = "stdlib", val_fraction: float = 0.1, max_bytes: int = 4_000_000, canary_vocab: int = 8
) -> Corpus:
    """Load ``"stdlib"``, ``"canary"``, a text path or a prepared directory (see the module
    docstring). ``max_bytes`` caps the tokens of byte corpora (for the canary: the number of
    tokens drawn). Results are cached per process: treat them as read-only."""
    return _load_cached(str(source), float(val_fraction), int(max_bytes), int(canary_vocab))
