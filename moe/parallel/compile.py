"""``torch.compile`` per block, in place, as torchtitan compiles a model: each transformer block
is compiled on its own (all blocks share one compiled graph: they run the same code), the
embedding, head and the loop around them stay eager.

In place (``nn.Module.compile``) rather than wrapped: parameter names do not change, so FSDP2,
checkpoints and name-seeded initialisation see the same model. Apply before FSDP2 sharding,
not to activation-checkpointed blocks (refused: see ``moe.parallel.activation_checkpointing``).
``fullgraph=True`` demands one graph per block without a break: single-process blocks with the ``topk`` router or the prefix-scoped
``capacity`` router trace that way (``tests/test_compile.py``); expert parallelism exchanges
data-dependent row counts between ranks, which breaks the graph, so use the default there.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from moe.parallel.activation_checkpointing import COMPILED_REFUSAL, checkpoint_mode


def compile_blocks(blocks: Iterable[nn.Module], fullgraph: bool = False, **options) -> None:
    """Compile each of ``blocks`` in place (``options`` go to ``torch.compile``); ValueError for
    a block that is activation-checkpointed (see ``moe.parallel.activation_checkpointing``)."""
    blocks = list(blocks)
    if any(checkpoint_mode(b) != "none" for b in blocks):
        raise ValueError(COMPILED_REFUSAL)
    for block in blocks:
        block.compile(fullgraph=fullgraph, **options)
