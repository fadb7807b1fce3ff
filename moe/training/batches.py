"""The data section of a run: the corpus, the sequence length and the global batch, and each
rank's slice of the batch of every step.

Shape legend: B batch (local to a rank), T sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moe.checks import positive_int
from moe.data import Corpus, batch_offsets, eval_offsets, load_corpus, windows


@dataclass
class DataConfig:
    """What a run reads and how much of it each step sees."""

    data: str = "stdlib"
    """Corpus: "stdlib" (the Python standard library's source), "canary" (uniform random tokens) or a path."""
    val_fraction: float = 0.1
    """Fraction of the token stream held out for validation (the end of each of 20 segments)."""
    max_bytes: int = 4_000_000
    """Tokens read from the corpus (for the canary: tokens drawn)."""
    canary_vocab: int = 8
    """Vocabulary of the canary corpus."""
    seq_len: int = 128
    """T: training and evaluation sequence length."""
    batch_size: int = 16
    """Global batch size (sequences per optimizer step, summed over data-parallel ranks)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "canary_vocab", "seq_len", "batch_size"):
            positive_int(name, getattr(self, name))
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.data not in ("stdlib", "canary") and not Path(self.data).exists():
            raise ValueError(f"--data {self.data!r}: no such file or directory (or use stdlib or canary)")

    def load(self) -> Corpus:
        """The corpus, split; ValueError if either part is shorter than one window of seq_len + 1 tokens."""
        corpus = load_corpus(self.data, self.val_fraction, self.max_bytes, self.canary_vocab)
        for part in ("train", "val"):
            n = getattr(corpus, part).numel()
            if n <= self.seq_len:
                raise ValueError(
                    f"the corpus {corpus.source} has {n:,} {part} tokens, fewer than one window of "
                    f"seq_len + 1 = {self.seq_len + 1}: use more data or a smaller --seq-len"
                )
        return corpus


def local_batch(
    corpus: Corpus, cfg: DataConfig, seed: int, step: int, device: torch.device, data_parallel: tuple[int, int] = (0, 1)
) -> tuple[Tensor, Tensor]:
    """(idx_BT, targets_BT) of this rank: its contiguous slice of the global batch of ``step``
    (a function of (seed, step)); ``data_parallel`` = (rank, size) among the data-parallel ranks."""
    rank, size = data_parallel
    if cfg.batch_size % size:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by {size} data-parallel ranks")
    b = cfg.batch_size // size
    offsets_B = batch_offsets(corpus.train.numel(), cfg.seq_len, cfg.batch_size, seed, step)
    idx_BT, targets_BT = windows(corpus.train, offsets_B[rank * b : (rank + 1) * b], cfg.seq_len)
    check_vocabulary(corpus, targets_BT, idx_BT[:, :1], where="a training batch")
    return idx_BT.to(device), targets_BT.to(device)


def check_vocabulary(corpus: Corpus, *ids: Tensor, where: str) -> None:
    """ValueError in one line if ``ids`` (of ``corpus``) hold a token outside its vocabulary:
    a prepared directory whose manifest's ``vocab_size`` is too small."""
    high = max(int(t.max()) for t in ids if t.numel())
    if high >= corpus.vocab_size:
        raise ValueError(
            f"{where} of {corpus.source} holds token id {high:,}, outside its vocabulary of {corpus.vocab_size:,} "
            "(the manifest's vocab_size): prepare the data again (python -m moe.data prepare)"
        )


def check_eval_windows(corpus: Corpus, seq_len: int, num_windows: int) -> None:
    """ValueError naming the corpus when its validation split holds fewer than ``num_windows``
    windows of ``seq_len`` + 1 tokens (saying about how large a corpus would); then
    :func:`check_vocabulary` on the validation windows an evaluation reads (``moe.eval.evaluate``)."""
    n_val = corpus.val.numel()
    available = (n_val - 1) // seq_len  # eval_offsets' windows: T apart, each reading T + 1 tokens
    if available < num_windows:
        total = corpus.train.numel() + n_val
        needed = -(-total * (num_windows * seq_len + 1) // n_val)  # the same split, scaled up
        raise ValueError(
            f"the corpus {corpus.source} has {n_val:,} val tokens, {available:,} windows of seq_len {seq_len}, "
            f"fewer than the {num_windows:,} of --eval-windows: use more data (about {needed:,} tokens in all), "
            "a smaller --eval-windows or a larger --val-fraction"
        )
    offsets_W = eval_offsets(n_val, seq_len, num_windows)
    check_vocabulary(corpus, *windows(corpus.val, offsets_W, seq_len), where="the validation windows")
