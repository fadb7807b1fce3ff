"""Training batches and evaluation windows: start offsets drawn as a pure function of
(seed, step), and the windows gathered from any token source (a tensor, or memory-mapped
shards that read only the rows asked for).

Shape legend: B batch, T sequence length, W evaluation windows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.data.corpus import TokenSource


def batch_offsets(num_tokens: int, seq_len: int, batch_size: int, seed: int, step: int) -> Tensor:
    """int64 [B]: start offsets of the training windows of ``step``: a pure function of
    (seed, step), so a resumed run draws the same batches and any process can draw any step."""
    if num_tokens < seq_len + 1:
        raise ValueError(f"training split has {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, num_tokens - seq_len, (batch_size,), generator=g)


def windows(tokens: Tensor | TokenSource, offsets_B: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(idx_BT, targets_BT) int64: inputs tokens[o:o+T] and next tokens tokens[o+1:o+T+1];
    only these B * (T + 1) positions of ``tokens`` are read."""
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
