"""Dead experts are exactly the experts that received no token: an expert below the mean load, or
with one token, is alive. Hand cases through ``moe.balance.balance_summary`` and through the
global figures of an evaluation, which sum the routings' counts over batches first."""

from __future__ import annotations

import torch
from helpers import identity_router

from moe.balance import balance_summary
from moe.eval import BalanceCounts

TOKENS_LE = torch.tensor(
    [
        [5, 1, 0, 2],  # mean 2: expert 1 (1 token) is below the mean and alive; expert 2 is dead
        [0, 3, 3, 0],  # two dead
        [2, 2, 2, 2],  # none
        [1, 1, 1, 9],  # three experts with a single token, far below the mean 3: none dead
    ]
)


def test_dead_experts_are_exactly_those_with_no_token():
    s = balance_summary(TOKENS_LE, "train_")
    assert s["train_dead_experts_layers"] == [1, 2, 0, 0], s["train_dead_experts_layers"]
    assert s["train_dead_experts"] == 3


def _routing_to(experts: list[int]):
    """A top-1 routing whose token i goes to ``experts[i]`` (the logits are the input features)."""
    x = torch.zeros(1, len(experts), 4, dtype=torch.float64)
    x[0, torch.arange(len(experts)), torch.tensor(experts)] = 5.0
    return identity_router("topk", 4, top_k=1)(x)


def test_an_expert_is_dead_only_if_no_batch_of_an_evaluation_gave_it_a_token():
    """An evaluation's global figures (``moe.eval.BalanceCounts``): expert 0 is idle in the first
    batch, expert 1 in the second, where it was served once (1 token in all, below the mean of 2):
    both alive; expert 2 is never served."""
    counts = BalanceCounts()
    counts.add([_routing_to([1, 3, 3, 3])])
    counts.add([_routing_to([0, 0, 3, 0])])
    s = counts.summary()
    assert s["global_dead_experts_layers"] == [1] and s["global_dead_experts"] == 1, s
