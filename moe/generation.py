"""Sampling from any causal LM of the package: ``MoETransformer`` and a swapped Hugging Face
model (``HFCausalLM``) alike, through the interface of :mod:`moe.lm` (``model(idx_BT, cache=)``,
``model.init_cache(B, max_len)``, ``model.decode_support()``).

Shape legend: B batch, T prompt, S prompt + new tokens, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.checks import positive_int


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor | list[Tensor],
    max_new_tokens: int,
    *,
    context: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    recompute: bool = False,
    return_logits: bool = False,
) -> Tensor | list[Tensor] | tuple[Tensor | list[Tensor], Tensor]:
    """Sample ``max_new_tokens`` tokens after each prompt from ``model``, in eval mode, with a KV
    cache.

    ``idx``: int64 [B, T] prompts, or a list of B 1-D prompts of different lengths. Returns
    the prompts followed by their new tokens ([B, T + max_new_tokens], or a list). All rows
    advance together, one position per step: a row whose prompt is longer than the shortest
    one is fed its own next prompt token instead of a sample until its prompt is used up, so
    every row sits at its own absolute positions with no padding in attention or routing
    (rows of shorter prompts run past their budget; those tokens are cut off).

    ``temperature`` 0 is greedy; ``top_k`` samples among the k most likely tokens; ``seed``
    seeds a private generator. Routers that are not decode-consistent (e.g. expert choice,
    sequence-sized capacity) cannot route from a cache: ValueError, unless ``recompute=True``,
    which forwards the whole prefix at every step (what serving such a model really costs;
    it also works for every other router).

    ``context``: the positions the model reads. Past it (a prefix longer than ``context``),
    the next token is predicted from the last ``context`` tokens alone, as nanoGPT's sampler
    crops: that window is forwarded afresh at positions 0..context-1, without the cache (whose
    positions no longer apply), so a router with decode state routes it from a fresh state as a
    full forward does; the same window with or without ``recompute``. ``return_logits``: also
    return the float logits computed for positions c..S-2 of the S = longest prompt +
    max_new_tokens positions decoded, [B, S-1-c, V], where c = max(0, shortest prompt -
    context) prompt positions were cropped before the first forward (within the context, for
    a decode-consistent router, a full forward of those S tokens gives the same, up to
    rounding).
    """
    positive_int("context", context)
    prompts = _checked_prompts(idx, max_new_tokens, temperature, top_k)
    lengths = [p.numel() for p in prompts]
    b, shortest, total = len(prompts), min(lengths), max(lengths) + max_new_tokens
    was_training = model.training
    model.eval()
    try:
        if not recompute:
            reason = model.decode_support()
            if reason is not None:
                raise ValueError(
                    f"cannot decode with a KV cache: {reason}. Pass recompute=True to reroute "
                    "the whole prefix at every step (slow; what this router needs at inference)"
                )
        device = next(model.parameters()).device
        seq_BS = torch.zeros(b, total, dtype=torch.long, device=device)
        forced_BS = torch.zeros(b, total, dtype=torch.bool, device=device)
        for row, p in enumerate(prompts):
            seq_BS[row, : p.numel()] = p.to(device)
            forced_BS[row, : p.numel()] = True
        gen = None if seed is None else torch.Generator(device).manual_seed(seed)
        cache = None if recompute else model.init_cache(b, min(total, context))
        cropped = max(0, shortest - context)
        prefill_BT = seq_BS[:, cropped:shortest]
        chunks_BTV = [model(prefill_BT, cache=None if cropped else cache).logits.float()]  # logits, chunk by chunk
        for s in range(shortest, total):
            next_B = _sample(chunks_BTV[-1][:, -1], temperature, top_k, gen)
            seq_BS[:, s] = torch.where(forced_BS[:, s], seq_BS[:, s], next_B)
            if s + 1 < total:
                if s + 1 > context:  # past the context: the last `context` tokens, afresh
                    step_BT, step_cache = seq_BS[:, s + 1 - context : s + 1], None
                else:
                    step_BT, step_cache = (seq_BS[:, : s + 1], None) if recompute else (seq_BS[:, s : s + 1], cache)
                chunks_BTV.append(model(step_BT, cache=step_cache).logits[:, -1:].float())
    finally:
        model.train(was_training)
    out = seq_BS if isinstance(idx, Tensor) else [seq_BS[row, : n + max_new_tokens] for row, n in enumerate(lengths)]
    return (out, torch.cat(chunks_BTV, 1)[:, : total - 1 - cropped]) if return_logits else out


def _checked_prompts(idx, max_new_tokens: int, temperature: float, top_k: int | None) -> list[Tensor]:
    """The prompts of :func:`generate` as a list of 1-D tensors; ValueError for bad arguments."""
    if isinstance(idx, Tensor) and idx.dim() != 2:
        raise ValueError(
            f"expected int64 token ids of shape [B, T] or a list of 1-D prompts, got shape {tuple(idx.shape)}"
        )
    prompts = list(idx)
    if not prompts or any(
        not isinstance(p, Tensor) or p.dim() != 1 or p.numel() == 0 or p.dtype != torch.long for p in prompts
    ):
        raise ValueError("idx must be int64 [B, T] token ids or a list of non-empty 1-D int64 prompts")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    return prompts


def _sample(logits_BV: Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> Tensor:
    """int64 [B]: the next token of each row; temperature 0 is greedy."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    return torch.multinomial(F.softmax(logits_BV, dim=-1), 1, generator=gen).squeeze(-1)
