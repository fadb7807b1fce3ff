"""The capacity router at two edges a mutation pass found open, each against a reference
written here: priority "choice" over a batch group queues each choice time-major (position,
then sample), a sequential walk in Python; and a replayed forward reports the capacity of the
forward it replays (a batch group's N tokens, not T)."""

from __future__ import annotations

import torch
from helpers import assignments, identity_router

import moe


def walk(x_BTE: torch.Tensor, k: int, capacity: int) -> list[tuple[int, int]]:
    """Each token's top-k experts; queue first choices, then second ones, each by position then
    sample; an expert keeps its first ``capacity`` requests."""
    b, t, e = x_BTE.shape
    top = torch.topk(x_BTE.reshape(b * t, e), k, dim=-1).indices.tolist()
    kept, load = [], [0] * e
    for j in range(k):
        for pos in range(t):
            for s in range(b):
                n = s * t + pos
                if load[top[n][j]] < capacity:
                    load[top[n][j]] += 1
                    kept.append((n, top[n][j]))
    return sorted(kept)


def test_choice_priority_over_a_batch_group_queues_time_major():
    b, t, e, k = 2, 6, 4, 2
    x = torch.randn(b, t, e, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    r = identity_router("capacity", e, top_k=k, capacity_factor=0.5, priority="choice", group="batch")
    c = moe.routing.capacity_per_group(0.5, b * t, k, e)
    assert c == 3
    assert assignments(r(x)) == walk(x, k, c)


def test_replay_reports_the_capacity_of_the_forward_it_replays():
    b, t, e, k = 3, 4, 4, 2
    x = torch.randn(b, t, e, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    r = identity_router("capacity", e, top_k=k, capacity_factor=1.0, group="batch")
    forward = r(x)
    expert_NK = torch.full((b * t, k), -1)
    for n, j in assignments(forward):
        expert_NK[n, int((expert_NK[n] >= 0).sum())] = j
    replayed = r.replay(x.reshape(b * t, e), x, (b, t), expert_NK, decoding=False)
    assert assignments(replayed) == assignments(forward)
    assert int(replayed.stats["capacity"]) == int(forward.stats["capacity"]) == 6  # ceil(1.0 * 12 * 2 / 4)
