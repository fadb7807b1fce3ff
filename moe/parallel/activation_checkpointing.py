"""Activation checkpointing per block: keep less of the forward, recompute it in the backward.

Modes (``apply_activation_checkpointing(blocks, mode)``):

* ``"none"``: every activation is kept (the default);
* ``"full"``: a block keeps only its input; the backward runs its forward again;
* ``"selective"``: a block keeps the outputs of its matrix products and attention (the
  expensive ops) and recomputes everything else (norms, activations, routing, gathers), an
  op-level policy through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

Losses and gradients equal the run without checkpointing: the recomputed forward repeats the
same deterministic ops on the same inputs. Blocks may update buffers during their forward
(routers accumulate load statistics for the step after); the recomputation restores every
buffer of the block afterwards, so that state counts each forward once.

The block's ``forward`` is replaced on the instance: parameter names do not change, so
FSDP2, checkpoints and name-seeded initialisation see the same model. Not together with
``torch.compile`` of the same block (refused): traced by dynamo, the recomputation replays
the buffer updates (measured: load statistics counted twice), and the restoring context
manager above cannot run inside a graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
COMPILED_REFUSAL = (
    "activation checkpointing of a compiled block is not supported: traced, the recomputation replays the routers' "
    "buffer updates (load statistics counted twice, measured); use one of the two"
)

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.bmm.default,
        _aten.addmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    )
    if op is not None
)
"""The ops whose outputs ``"selective"`` keeps (the rest is recomputed)."""


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


@contextlib.contextmanager
def _recomputation(module: nn.Module, inner) -> Iterator[None]:
    with _buffers_restored(module), inner:
        yield


def _contexts(module: nn.Module, selective: bool):
    """(context of the first forward, context of the recomputation)."""
    if selective:
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_save_matmuls)
    else:
        forward_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
    return forward_ctx, _recomputation(module, recompute_ctx)


def _checkpointed(forward, module: nn.Module, selective: bool, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        raise ValueError(COMPILED_REFUSAL)
    context_fn = functools.partial(_contexts, module, selective)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def checkpoint_mode(block: nn.Module) -> str:
    """The mode :func:`apply_activation_checkpointing` gave ``block`` ("none" if it was not given one)."""
    return getattr(block, "activation_checkpointing", "none")


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Checkpoint each of ``blocks`` (e.g. a model's transformer blocks) as ``mode`` says (see
    the module docstring); call before FSDP2 sharding, as torchtitan does."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, block, mode == "selective")
        block.activation_checkpointing = mode
