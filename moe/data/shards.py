"""Prepared token directories (written by ``python -m moe.data prepare``) read through
``numpy.memmap``: nothing is loaded whole, a batch reads only its own rows.

A prepared directory holds ``manifest.json`` (written last: a directory without it is not a
prepared directory), the token shards (raw little-endian ``uint16`` or ``uint32`` arrays, one
token id per element, no header) and the tokenizer (``tokenizer.json``). The stream is the
shards concatenated in manifest order; :func:`load_prepared` splits it by
``moe.data.corpus.split_ranges`` into training and validation views (:class:`TokenShards`)
over the same memory maps.

Shape legend: N tokens of a view, I positions asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moe.checks import first_few
from moe.data.corpus import Corpus, split_ranges

MANIFEST = "manifest.json"
FORMAT = "moe.data.shards"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Token dtype names of the manifest and their (little-endian) numpy dtypes."""
REQUIRED = ("format", "vocab_size", "dtype", "shards", "num_tokens", "tokenizer")


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id of a vocabulary of ``vocab_size`` fits in 16 bits (ids 0..65535:
    65,536 tokens), else ``"uint32"``."""
    return "uint16" if vocab_size <= 65_536 else "uint32"


def check_vocabulary_fits(vocab_size: int, dtype: str, where: str) -> None:
    """ValueError unless every id of a vocabulary of ``vocab_size`` fits the shards' ``dtype``."""
    largest = int(np.iinfo(DTYPES[dtype]).max)
    if vocab_size - 1 > largest:
        raise ValueError(
            f"{where}: vocab_size {vocab_size:,} does not fit {dtype} shards (ids up to {largest:,}): "
            f"ids would wrap around; use {token_dtype(vocab_size)}"
        )


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a ``manifest.json``."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def refuse_without_manifest(path: str | Path) -> None:
    """ValueError when ``path`` is a directory that holds what a prepared directory holds (its
    ``shard-*.bin`` files or ``tokenizer.json``) but no manifest: its files are token ids and a
    tokenizer, never text to train on."""
    p = Path(path)
    if not p.is_dir() or (p / MANIFEST).is_file():
        return
    found = sorted(f.name for f in p.glob("shard-*.bin")) + (
        ["tokenizer.json"] if (p / "tokenizer.json").is_file() else []
    )
    if found:
        raise ValueError(
            f"{str(p)!r} holds {first_few(found)} but no {MANIFEST}: a prepared directory without its manifest "
            "(deleted, or never written) is not read; prepare it again with python -m moe.data prepare"
        )


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a prepared directory, checked against its shard files' sizes."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{directory / MANIFEST} does not read as a manifest: {e}") from None
    missing = [k for k in REQUIRED if k not in manifest]
    if missing or manifest["format"] != FORMAT:
        raise ValueError(
            f"{directory / MANIFEST} is not a {FORMAT} manifest (missing {missing}, format {manifest.get('format')!r})"
        )
    if manifest["dtype"] not in DTYPES:
        raise ValueError(f"{directory / MANIFEST}: dtype must be one of {list(DTYPES)}, got {manifest['dtype']!r}")
    check_vocabulary_fits(int(manifest["vocab_size"]), manifest["dtype"], str(directory / MANIFEST))
    itemsize = DTYPES[manifest["dtype"]].itemsize
    for shard in manifest["shards"]:
        f = directory / shard["file"]
        size = f.stat().st_size if f.is_file() else None
        if shard["num_tokens"] <= 0 or size != shard["num_tokens"] * itemsize:
            raise ValueError(
                f"shard {str(f)!r} holds {size} bytes, the manifest says {shard['num_tokens']} tokens "
                f"of {itemsize} bytes"
            )
    if sum(s["num_tokens"] for s in manifest["shards"]) != manifest["num_tokens"]:
        raise ValueError(f"{directory / MANIFEST}: num_tokens={manifest['num_tokens']} is not the sum over its shards")
    return manifest


class TokenShards:
    """A read-only 1-D view of token ids made of pieces of memory-mapped shards, in order.

    ``view[idx]`` (an integer tensor of positions, any shape, or a slice) returns the int64
    ids at those positions, reading only them; ``numel()`` is the view's length.
    """

    def __init__(self, pieces: list[tuple[np.memmap, int, int]]) -> None:
        self.pieces = [p for p in pieces if p[2] > p[1]]
        """(memory map, start, end): element ranges of shards, in view order."""
        lengths = np.array([end - start for _, start, end in self.pieces], dtype=np.int64)
        self.ends = np.cumsum(lengths)
        """int64 [pieces]: where each piece ends in the view."""
        self.starts = self.ends - lengths
        """int64 [pieces]: where each piece starts in the view."""

    def numel(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, idx: Tensor | slice) -> Tensor:
        if isinstance(idx, slice):
            idx = torch.arange(*idx.indices(self.numel()))
        pos_I = idx.reshape(-1).numpy().astype(np.int64, copy=False)
        n = self.numel()
        if pos_I.size and (pos_I.min() < 0 or pos_I.max() >= n):
            raise IndexError(f"token positions [{pos_I.min()}, {pos_I.max()}] out of range for a view of {n} tokens")
        piece_I = np.searchsorted(self.ends, pos_I, side="right")
        out_I = np.empty(pos_I.shape, dtype=np.int64)
        # positions grouped by piece (one pass over them, however many pieces a batch touches)
        order_I = np.argsort(piece_I, kind="stable")
        for group in np.split(order_I, np.flatnonzero(np.diff(piece_I[order_I])) + 1):
            if group.size:
                p = piece_I[group[0]]
                mm, start, _ = self.pieces[p]
                out_I[group] = mm[start + pos_I[group] - self.starts[p]]
        return torch.from_numpy(out_I).view(idx.shape)


def views(maps: list[np.memmap], ranges: list[tuple[int, int]]) -> TokenShards:
    """The view of the stream ``maps`` (concatenated) restricted to ``ranges`` of stream positions."""
    starts = np.cumsum([0] + [m.shape[0] for m in maps[:-1]], dtype=np.int64)
    pieces = []
    for a, b in ranges:
        for mm, s in zip(maps, starts.tolist()):
            lo, hi = max(a, s), min(b, s + mm.shape[0])
            if lo < hi:
                pieces.append((mm, lo - s, hi - s))
    return TokenShards(pieces)


def load_prepared(directory: str | Path, val_fraction: float) -> Corpus:
    """A prepared directory as a corpus of memory-mapped training and validation views."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    dtype = DTYPES[manifest["dtype"]]
    maps = [
        np.memmap(directory / s["file"], dtype=dtype, mode="r", shape=(s["num_tokens"],)) for s in manifest["shards"]
    ]
    train, val = split_ranges(manifest["num_tokens"], val_fraction)
    tokenizer = directory / manifest["tokenizer"]
    where = (
        f"{directory} ({manifest['num_tokens']:,} tokens in {len(maps)} shards, vocabulary {manifest['vocab_size']:,})"
    )
    return Corpus(
        views(maps, train),
        views(maps, val),
        int(manifest["vocab_size"]),
        where,
        str(tokenizer) if tokenizer.is_file() else None,
    )
