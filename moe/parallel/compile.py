"""``torch.compile`` per block, in place, as torchtitan compiles a model: each transformer block
is compiled on its own (all blocks share one compiled graph: they run the same code), the
embedding, head and the loop around them stay eager.

In place (the block's ``forward`` replaced by its compiled version on the instance) rather
than wrapped: parameter names do not change, so FSDP2, checkpoints and name-seeded
initialisation see the same model; the module's hooks (FSDP2's gathers) stay eager around the
compiled forward. Compile before activation checkpointing (``moe.parallel.recompute``:
the checkpoint then stays eager around the compiled forward, which it reruns in the backward)
and before FSDP2 sharding.
``fullgraph=True`` demands one graph per block without a break: single-process blocks with the ``topk`` router or the prefix-scoped
``capacity`` router trace that way (``tests/test_compile.py``); expert parallelism exchanges
data-dependent row counts between ranks, which breaks the graph, so use the default there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from moe.parallel.recompute import checkpoint_mode

CHECKPOINTED_REFUSAL = (
    "compile a block before checkpointing it: traced, the recomputation would replay the routers' buffer updates "
    "(compile_blocks, then apply_activation_checkpointing)"
)


def compile_blocks(blocks: Iterable[nn.Module], fullgraph: bool = False, **options) -> None:
    """Compile the forward of each of ``blocks`` in place (``options`` go to ``torch.compile``)
    and mark the block ``compiled``; ValueError for a block already activation-checkpointed
    (see the module docstring)."""
    blocks = list(blocks)
    if any(checkpoint_mode(b) != "none" for b in blocks):
        raise ValueError(CHECKPOINTED_REFUSAL)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, **options)
        block.compiled = True
