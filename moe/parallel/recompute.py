"""Activation checkpointing per block: keep less of the forward, recompute it in the backward.

Modes (``apply_activation_checkpointing(blocks, mode)``):

* ``"none"``: every activation is kept (the default);
* ``"full"``: a block keeps only its input; the backward runs its forward again;
* ``"selective"``: a block keeps the outputs of its matrix products and attention (the
  expensive ops; with ``backend="grouped_mm"`` the experts' grouped-GEMM operator, whose
  outputs are its products) and recomputes everything else (norms, activations, routing,
  gathers), an op-level policy through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

Losses and gradients equal the run without checkpointing: the recomputed forward repeats the
same deterministic ops on the same inputs. Blocks may update buffers during their forward
(routers accumulate load statistics for the step after); the recomputation restores every
buffer of the block afterwards, so that state counts each forward once.

The block's ``forward`` is replaced on the instance: parameter names do not change, so
FSDP2, checkpoints and name-seeded initialisation see the same model.

With ``torch.compile``: compile each block's forward first (``moe.parallel.compile``), then
checkpoint it. The checkpoint then stays eager around the compiled forward: the
recomputation reruns the compiled code and the buffers are restored as above. A checkpointed
block traced from outside is refused: dynamo would put the recomputation inside the graph,
where it replays the buffer updates (measured: load statistics counted twice) and the
restoring context manager cannot run. ``"selective"`` is refused over a compiled forward:
it chooses what to keep op by op as the ops run, and a compiled block runs the compiler's
fused kernels and out= variants instead (``"full"`` is exact there).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from causal_moe_kernels.torch_grouped import GROUPED_FFN_OP

MODES = ("none", "full", "selective")
TRACED_REFUSAL = (
    "a checkpointed block must not be traced by torch.compile (the recomputation would replay the routers' buffer "
    "updates): compile the block's forward first, then checkpoint it (moe.parallel.compile.compile_blocks)"
)
SELECTIVE_COMPILED_REFUSAL = (
    "selective activation checkpointing chooses ops as they run eagerly, and a compiled block runs fused kernels: "
    "use activation_checkpointing full with compile"
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
        getattr(getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None),
        GROUPED_FFN_OP,
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
        raise ValueError(TRACED_REFUSAL)
    context_fn = functools.partial(_contexts, module, selective)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def checkpoint_mode(block: nn.Module) -> str:
    """The mode :func:`apply_activation_checkpointing` gave ``block`` ("none" if it was not given one)."""
    return getattr(block, "activation_checkpointing", "none")


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Checkpoint each of ``blocks`` (e.g. a model's transformer blocks) as ``mode`` says (see
    the module docstring); call before FSDP2 sharding, as torchtitan does, and after compiling
    the blocks, if they are compiled (``"full"`` only)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return
    blocks = list(blocks)
    if mode == "selective" and any(getattr(b, "compiled", False) for b in blocks):
        raise ValueError(SELECTIVE_COMPILED_REFUSAL)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, block, mode == "selective")
        block.activation_checkpointing = mode
