"""Teacher-forced and causal (decoded) losses of a language model on validation windows,
importable without the training loop.

Shape legend: B batch, T sequence, V vocabulary, W evaluation windows, P evaluated positions
per window.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm

from moe.balance import active_experts_summary, balance_summary
from moe.checks import nonnegative_int, positive_int
from moe.data import eval_offsets, windows
from moe.lm import lm_loss


@dataclass
class EvalConfig:
    """The evaluation section of a training run (``moe.training``): when and on what
    :func:`evaluate` runs."""

    eval_every: int = 0
    """Evaluate every N steps (0 = only after the last step)."""
    eval_windows: int = 32
    """W: validation windows of ``seq_len`` tokens evaluated (W * T positions teacher-forced)."""
    eval_batch_size: int = 64
    """Windows per evaluation forward (routers grouped over the batch see this many sequences)."""
    causal_stride: int = 1
    """Causal loss at positions t = k-1, 2k-1, ... (every k-th); 1 = every position."""
    causal_batch_size: int | None = None
    """Windows decoded together for the causal loss (None: ``eval_batch_size``). A router that
    is not batch-invariant routes a sequence differently beside others, so its causal loss
    depends on this number: 1 is what one sequence decoded alone gets."""

    def __post_init__(self) -> None:
        nonnegative_int("eval_every", self.eval_every)
        for name in ("eval_windows", "eval_batch_size", "causal_stride"):
            positive_int(name, getattr(self, name))
        if self.causal_batch_size is not None:
            positive_int("causal_batch_size", self.causal_batch_size)


def format_difference(value: float, digits: int = 4, plus: bool = True) -> str:
    """A difference of losses (a leakage gap) as text: ``digits`` decimals, signed (``+`` too when
    ``plus``), but one that rounds to zero is ``0.0000``, without a sign (never ``-0.0000``)."""
    text = f"{value:+.{digits}f}" if plus else f"{value:.{digits}f}"
    return text.lstrip("+-") if float(text) == 0 else text


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing (fp32) elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    val_tokens: Tensor,
    seq_len: int,
    num_windows: int,
    causal_stride: int = 1,
    batch_size: int = 64,
    device: torch.device | None = None,
    causal: bool = True,
    with_train_mode: bool = False,
    causal_method: str = "auto",
    causal_batch_size: int | None = None,
    progress: str | None = None,
) -> dict:
    """Teacher-forced and causal loss (eval mode) on the same validation positions.

    W evenly spaced windows of T tokens; evaluated positions t = k-1, 2k-1, ... (k =
    ``causal_stride``). Teacher-forced: one full-window forward, the loss read at those
    positions. Causal: the loss at t computed as decoding computes it, ``causal_batch_size``
    windows (default: ``batch_size``) decoded together as batched decoding would run them (for
    a router that is not batch-invariant the number matters: 1 is a sequence decoded alone).
    ``causal_method``:

    * ``"cache"``: incremental decoding through the model's KV cache and its routers' decode
      states (``model.init_cache``): one token at a time when k = 1; otherwise each cached
      forward takes the next k tokens (a chunk, as a prompt is prefilled) and the loss is read
      at its last position, an evaluated one. A decode-consistent router routes a chunk exactly
      as token-by-token decoding would (``tests/test_decode.py``). Needs a model whose routers
      can decode (``decode_support()``). Cost: T/k cached forwards of k tokens.
    * ``"recompute"``: for each evaluated t, a forward of the prefix 0..t alone, the loss of
      its last position (T/k forwards of up to T tokens; what a router that cannot decode
      from a state needs).
    * ``"auto"`` (default): ``"cache"`` where the model supports it, else ``"recompute"``.

    Both give the same numbers (to rounding) where both apply. Returns
    ``teacher_forced_loss``, ``causal_loss``, ``leakage_gap`` (causal minus
    teacher-forced) with its standard error ``leakage_gap_se`` (over positions),
    ``teacher_forced_loss_all`` (every position) and ``eval_positions``, and, for a model
    whose output lists its routings, the balance of the eval-mode teacher-forced forwards over
    all W windows (:mod:`moe.balance` with prefix ``global_``: ``global_max_vio`` is
    MaxVio_global, ``global_active_experts_mean`` the experts per token).

    ``causal=False`` skips the prefix forwards (only the teacher-forced keys are returned).
    ``progress`` (a description, e.g. ``"eval step 50"``) shows a progress bar of the forwards
    on stderr, removed when done.
    ``with_train_mode`` adds ``train_mode_loss``: the teacher-forced loss with training-mode
    routing, which is what the training curve reports. Routers that learn from batches record
    statistics in training mode, so ask for it only when training is over.
    """
    if causal_method not in ("auto", "cache", "recompute"):
        raise ValueError(f"causal_method must be 'auto', 'cache' or 'recompute', got {causal_method!r}")
    device = device or next(model.parameters()).device
    was_training = model.training
    idx_WT, targets_WT = windows(val_tokens, eval_offsets(val_tokens.numel(), seq_len, num_windows), seq_len)
    pos_P = torch.arange(causal_stride - 1, seq_len, causal_stride)

    model.eval()
    if causal and causal_method != "recompute":
        try:
            causal_method = _causal_method(model, causal_method)
        except ValueError:
            model.train(was_training)
            raise

    decode_batch = batch_size if causal_batch_size is None else positive_int("causal_batch_size", causal_batch_size)
    forwards = -(-num_windows // batch_size) + (-(-num_windows // decode_batch) * pos_P.numel() if causal else 0)
    bar = tqdm(total=forwards, desc=progress, disable=progress is None, leave=False, unit="forward", dynamic_ncols=True)
    balance, causal_WP = BalanceCounts(), []
    tf_WT, train_WT = _teacher_forced(model, idx_WT, targets_WT, batch_size, device, with_train_mode, balance, bar)
    if causal:
        model.eval()
        for start in range(0, idx_WT.shape[0], decode_batch):  # float64 [B, P] per chunk decoded together
            idx_BT = idx_WT[start : start + decode_batch].to(device)
            targets_BT = targets_WT[start : start + decode_batch].to(device)
            if causal_method == "cache":  # through the cache
                seq_len = idx_WT.shape[1]
                causal_WP.append(_decoded_nll(model, idx_BT, targets_BT, pos_P, causal_stride, seq_len, device, bar))
                continue
            prefixes = []  # "recompute": each evaluated position from a forward of its prefix alone
            for t in pos_P.tolist():
                prefixes.append(_nll(model, idx_BT[:, : t + 1], targets_BT[:, : t + 1], device)[:, -1:])
                bar.update()
            causal_WP.append(torch.cat(prefixes, 1))
    bar.close()
    model.train(was_training)
    return {**_summary(torch.cat(tf_WT), causal_WP, train_WT, pos_P, num_windows), **balance.summary()}


def _teacher_forced(
    model: nn.Module,
    idx_WT: Tensor,
    targets_WT: Tensor,
    batch_size: int,
    device: torch.device,
    with_train_mode: bool,
    balance: BalanceCounts,
    bar: tqdm,
) -> tuple[list[Tensor], list[Tensor]]:
    """The per-position losses of full-window forwards, ``batch_size`` windows at a time, in eval
    mode (their routings counted into ``balance``) and, ``with_train_mode``, in training mode."""
    tf_WT, train_WT = [], []
    for start in range(0, idx_WT.shape[0], batch_size):
        idx_BT = idx_WT[start : start + batch_size].to(device)
        targets_BT = targets_WT[start : start + batch_size].to(device)
        model.eval()
        tf_WT.append(_nll(model, idx_BT, targets_BT, device, balance))
        if with_train_mode:
            model.train()
            train_WT.append(_nll(model, idx_BT, targets_BT, device))
        bar.update()
    return tf_WT, train_WT


class BalanceCounts:
    """Tokens per expert and experts per token of each MoE layer, summed over forwards."""

    def __init__(self) -> None:
        self.tokens_LE: Tensor | None = None
        self.active_LJ: Tensor | None = None

    def add(self, routings: list) -> None:
        if not routings:
            return
        tokens_LE = torch.stack([r.stats["tokens_per_expert"].detach().cpu() for r in routings])
        active_LJ = torch.stack([r.experts_per_token_histogram().cpu() for r in routings])
        self.tokens_LE = tokens_LE if self.tokens_LE is None else self.tokens_LE + tokens_LE
        self.active_LJ = active_LJ if self.active_LJ is None else self.active_LJ + active_LJ

    def summary(self) -> dict:
        if self.tokens_LE is None:
            return {}
        return {**balance_summary(self.tokens_LE, "global_"), **active_experts_summary(self.active_LJ, "global_")}


def _summary(tf_WT: Tensor, causal_WP: list[Tensor], train_WT: list[Tensor], pos_P: Tensor, num_windows: int) -> dict:
    """The figures :func:`evaluate` returns from its per-position losses."""
    out = {
        "teacher_forced_loss": tf_WT[:, pos_P].mean().item(),
        "teacher_forced_loss_all": tf_WT.mean().item(),
        "eval_positions": num_windows * pos_P.numel(),
    }
    if causal_WP:
        causal_WP = torch.cat(causal_WP)
        diff_WP = causal_WP - tf_WT[:, pos_P]
        out["causal_loss"] = causal_WP.mean().item()
        out["leakage_gap"] = diff_WP.mean().item()
        out["leakage_gap_se"] = (diff_WP.std() / math.sqrt(diff_WP.numel())).item() if diff_WP.numel() > 1 else 0.0
    if train_WT:
        out["train_mode_loss"] = torch.cat(train_WT)[:, pos_P].mean().item()
    return out


def _nll(
    model: nn.Module, idx_BT: Tensor, targets_BT: Tensor, device: torch.device, balance: BalanceCounts | None = None
) -> Tensor:
    """float64 [B, T] on the CPU: the loss at every position of one full forward (its routings
    counted into ``balance`` if given)."""
    with autocast(device):
        out = model(idx_BT)
    if balance is not None:
        balance.add(getattr(out, "routings", None))
    return lm_loss(out.logits, targets_BT, reduction="none").double().cpu()


def _decoded_nll(
    model: nn.Module,
    idx_BT: Tensor,
    targets_BT: Tensor,
    pos_P: Tensor,
    stride: int,
    seq_len: int,
    device: torch.device,
    bar: tqdm,
) -> Tensor:
    """float64 [B, P]: chunks of k = ``stride`` new tokens through the cache, each ending at an
    evaluated position, the loss read at its last one."""
    cache = model.init_cache(idx_BT.shape[0], seq_len)
    rows = []
    for t in pos_P.tolist():
        with autocast(device):
            logits_BV = model(idx_BT[:, t + 1 - stride : t + 1], cache=cache).logits[:, -1]
        rows.append(lm_loss(logits_BV, targets_BT[:, t], reduction="none").double().cpu())
        bar.update()
    return torch.stack(rows, 1)


def _causal_method(model: nn.Module, requested: str) -> str:
    """ "cache" or "recompute" for ``requested`` "auto" or "cache" (ValueError when "cache" is
    impossible: the model has no KV cache or a router cannot decode in eval mode)."""
    support = getattr(model, "decode_support", None)
    reason = "the model has no KV cache" if support is None else support()
    if reason is not None and requested == "cache":
        raise ValueError(f"causal_method='cache' impossible: {reason}")
    return "recompute" if reason is not None else "cache"
