"""The rank-deduplicated expert exchange (``ExpertParallel(dedup=True)``) on 2 gloo processes
when a token's experts live on both ranks and that token is both the last one sent to rank 0
and the first one sent to rank 1: one row per (token, rank) pair each way, outputs and
gradients those of one process, in float64. The other two-rank tests route every token within
one rank (groups mapped to ranks), where no such boundary occurs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.layer import MoELayer
from moe.parallel import ExpertParallel, load_full_state_dict, reduce_gradients
from moe.parallel.launch import ok_values, run_local

E = D = 4  # the gate is the identity: the features are the logits
ROWS = [[3.0, 2.0, 0.0, 0.0], [2.0, 3.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0]]
"""Each rank's tokens: two on experts {0, 1} (rank 0), the last on {1, 2} (both ranks)."""


def _worker(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(3)
    x = torch.tensor([ROWS, ROWS], dtype=torch.float64) + torch.rand(2, 3, D, dtype=torch.float64) / 10
    g = torch.randn(2, 3, D, dtype=torch.float64)
    full = MoELayer(D, 6, E, router="topk", top_k=2).double()
    with torch.no_grad():
        full.router.gate.weight.copy_(torch.eye(E))
    ep = MoELayer(D, 6, E, router="topk", top_k=2, expert_parallel=ExpertParallel(dist.group.WORLD, dedup=True))
    ep = ep.double()
    load_full_state_dict(ep, full.state_dict())
    x_full = x.clone().requires_grad_()
    (full(x_full) * g).sum().backward()
    x_r = x[rank : rank + 1].clone().requires_grad_()
    y_r = ep(x_r)
    (y_r * g[rank : rank + 1]).sum().backward()
    reduce_gradients(ep)
    start, stop = ep.local_experts
    out = {"output": float((y_r - full(x)[rank : rank + 1]).abs().max())}
    out["input_grad"] = float((x_r.grad - x_full.grad[rank : rank + 1]).abs().max())
    for name in ("w_gate", "w_up", "w_down"):
        want = getattr(full.experts, name).grad[start:stop]
        out[name] = float((getattr(ep.experts, name).grad * world - want).abs().max())
    return out


def test_dedup_exchange_of_a_token_on_both_ranks_equals_one_process():
    for rank, diffs in enumerate(ok_values(run_local(_worker, 2))):
        for key, diff in diffs.items():
            assert diff <= 1e-12, f"rank {rank} {key}: max diff {diff:.3e}"
