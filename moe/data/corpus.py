"""The corpus every run trains on: a token stream split into training and validation parts,
and the deterministic rule that splits it.

The split (:func:`split_ranges`) depends only on the stream's length: the stream is cut into
20 equal segments and the last ``val_fraction`` of each is validation, so validation samples
the whole corpus. Byte corpora and prepared token directories share the rule; for a prepared
directory the stream is its shards concatenated in manifest order, so the split does not
depend on how the tokens were cut into shard files.

Shape legend: N tokens of a split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from moe.data.tokenizer import load_tokenizer_file


class TokenSource(Protocol):
    """A read-only 1-D token sequence read on demand (``moe.data.shards.TokenShards``): what
    the loop and the evaluation need of a split besides a tensor."""

    def numel(self) -> int: ...

    def __getitem__(self, idx: Tensor) -> Tensor: ...


@dataclass
class Corpus:
    """A token stream split into training and validation parts."""

    train: Tensor | TokenSource
    """[N_train] training tokens: a uint8 tensor (byte corpora), or a memory-mapped source
    that reads only the positions asked for (prepared directories)."""
    val: Tensor | TokenSource
    """[N_val] validation tokens, of the same kind as ``train``."""
    vocab_size: int
    """Number of distinct token ids the model must cover (256 for bytes)."""
    source: str
    """Where the tokens came from, for logs."""
    tokenizer: str | None = None
    """The ``tokenizers`` JSON file whose ids these are (a prepared directory's); None: the
    ids are bytes, or the canary's symbols."""

    def __post_init__(self) -> None:
        for name in ("train", "val"):
            t = getattr(self, name)
            if isinstance(t, Tensor):
                if t.dim() != 1 or t.dtype != torch.uint8:
                    raise ValueError(f"Corpus.{name} must be a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
            elif not (callable(getattr(t, "numel", None)) and hasattr(t, "__getitem__")):
                raise ValueError(f"Corpus.{name} must be a tensor or a token source, got {type(t).__name__}")
        if self.vocab_size < 2:
            raise ValueError(f"Corpus.vocab_size must be >= 2, got {self.vocab_size}")

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of token ids: through the tokenizer, as UTF-8 bytes (invalid sequences replaced)
        for a byte corpus, or the ids written out for the canary."""
        ids = [int(i) for i in ids]
        if self.tokenizer is not None:
            return load_tokenizer_file(self.tokenizer).decode(ids, skip_special_tokens=False)
        if self.vocab_size == 256:
            return bytes(ids).decode("utf-8", errors="replace")
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (a prompt): through the tokenizer, or its UTF-8 bytes."""
        if self.tokenizer is not None:
            return load_tokenizer_file(self.tokenizer).encode(text, add_special_tokens=False).ids
        if self.vocab_size != 256:
            raise ValueError(f"corpus {self.source!r} has no text encoding (vocab_size={self.vocab_size})")
        return list(text.encode("utf-8"))


def split_ranges(
    num_tokens: int, val_fraction: float, num_segments: int = 20
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, val) as sorted lists of half-open [start, end) ranges of a stream of
    ``num_tokens``: ``min(num_segments, N_val)`` equal segments, the last tokens of each
    validation, ``N_val = max(1, floor(num_tokens * val_fraction))`` of them in total."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = num_tokens
    n_val = max(1, math.floor(n * val_fraction))
    if n - n_val < 1:
        raise ValueError(f"corpus of {n} tokens is too small to split with val_fraction={val_fraction}")
    segments = min(num_segments, n_val)
    train, val, prev_end = [], [], 0
    for k in range(segments):
        end = (k + 1) * n // segments
        # Cumulative targets telescope to n_val in total.
        take = (k + 1) * n_val // segments - k * n_val // segments
        if end - take > prev_end:
            train.append((prev_end, end - take))
        val.append((end - take, end))
        prev_end = end
    return train, val


def split(tokens: Tensor, val_fraction: float, num_segments: int = 20) -> tuple[Tensor, Tensor]:
    """(train, val) parts of a 1-D tensor by :func:`split_ranges`."""
    train, val = split_ranges(tokens.numel(), val_fraction, num_segments)
    return torch.cat([tokens[a:b] for a, b in train]), torch.cat([tokens[a:b] for a, b in val])
