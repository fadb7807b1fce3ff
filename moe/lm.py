"""The causal-LM interface every language model of the package follows (``MoETransformer``,
a pipeline of its stages, a swapped Hugging Face model): ``out = model(idx_BT, targets_BT)``
returns a :class:`ModelOutput`; :func:`check_token_ids` is the one validation of the token ids
and :func:`lm_loss` the one language-model loss. :class:`KVCache` is what decoding carries.

Shape legend: B batch, T sequence (new tokens), V vocabulary, H heads, Dh head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.routing import DecodeState, Routing


@dataclass
class ModelOutput:
    logits: Tensor
    """[B, T, V]."""
    aux_loss: Tensor
    """Scalar: the sum of every MoE block's ``Routing.aux_loss``."""
    routings: list[Routing]
    """One Routing per MoE block, in block order."""
    loss: Tensor | None = None
    """Mean next-token cross-entropy when targets were given (aux loss not included)."""


@dataclass
class KVCache:
    """What a forward needs to process only new tokens: every block's keys and values of the
    positions seen so far and every MoE block's router decode state. Made by ``init_cache``,
    updated in place by each forward. All B sequences are at the same position ``length``."""

    batch_size: int
    """B."""
    max_len: int
    """Positions the cache can hold."""
    keys: list[Tensor | None]
    """Per block [B, H, max_len, Dh] (allocated by the first forward, in its dtype)."""
    values: list[Tensor | None]
    """Per block, like ``keys``."""
    router_states: list[DecodeState | None]
    """Per block: its router's decode state (None for dense blocks)."""
    length: int = 0
    """Positions filled: the next token is at this absolute position."""


def check_token_ids(idx_BT: Tensor, max_seq_len: int | None = None, cache: KVCache | None = None) -> None:
    """ValueError unless ``idx_BT`` is int64/int32 [B, T] token ids that fit: T <= ``max_seq_len``
    without a cache (None: no limit), and B and T matching the cache's batch and free room."""
    if idx_BT.dim() != 2 or idx_BT.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expected int64 token ids of shape [B, T], got {idx_BT.dtype} {tuple(idx_BT.shape)}")
    b, t = idx_BT.shape
    if cache is None:
        if max_seq_len is not None and t > max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={max_seq_len}")
        return
    if b != cache.batch_size:
        raise ValueError(f"cache is for batch size {cache.batch_size}, got token ids of shape {(b, t)}")
    if cache.length + t > cache.max_len:
        raise ValueError(f"cache holds {cache.length} of at most {cache.max_len} positions; cannot add {t}")


def lm_loss(logits_BTV: Tensor, targets_BT: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy in fp32 of logits [..., V] against targets [...] (already
    shifted): the mean, or with ``reduction="none"`` one loss per position (shape of the targets)."""
    loss = F.cross_entropy(
        logits_BTV.float().reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1), reduction=reduction
    )
    return loss.view(targets_BT.shape) if reduction == "none" else loss


def empty_cache(
    n_layers: int, max_seq_len: int, blocks: dict[int, nn.Module], batch_size: int, max_len: int | None, decode_support
) -> KVCache:
    """An empty :class:`KVCache` for a model of ``n_layers`` blocks, with the router decode states
    of ``blocks`` (block index -> block with ``init_decode_state(B)``: all of them, or a pipeline
    stage's). ``max_len`` defaults to ``max_seq_len``; ValueError if it is out of range or if
    ``decode_support()`` gives a reason the routers cannot decode."""
    max_len = max_seq_len if max_len is None else max_len
    if not isinstance(max_len, int) or not 0 < max_len <= max_seq_len:
        raise ValueError(f"max_len must be an integer in [1, max_seq_len={max_seq_len}], got {max_len!r}")
    reason = decode_support()
    if reason is not None:
        raise ValueError(reason)
    states: list[DecodeState | None] = [None] * n_layers
    for i, block in blocks.items():
        states[i] = block.init_decode_state(batch_size)
    return KVCache(batch_size, max_len, [None] * n_layers, [None] * n_layers, states)
