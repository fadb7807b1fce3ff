"""Expert-parallel all-to-all where what a rank sends to each peer differs from what it receives
from it, while every rank sends as many rows as it receives: swapping send and receive split
sizes anywhere then moves rows to the wrong places (wrong values) instead of failing on sizes.
With two ranks equal totals force equal splits, so this needs three (gloo, one spawn).

Rows rank r sends to rank p (SENDS[r][p]); every row and column sums to 3:

    to:     0  1  2
    from 0  1  2  0
    from 1  0  1  2
    from 2  2  0  1

1. ``all_to_all_rows``: each row carries its (source, destination, index) as a number, so the
   received rows are known by hand; the backward of sum(out * c) with a distinct c per received
   row must return to each sent row the c of the slot it landed in.
2. ``expert_parallel_ffn`` with E = 6 experts (two per rank) and hand-set assignments that make
   exactly SENDS: the output and every gradient against a per-assignment float64 loop over all
   ranks' tokens with the full expert weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import MoELayer
from moe.parallel import ExpertParallel, expert_parallel_ffn, load_full_state_dict
from moe.parallel.exchange import all_to_all_rows
from moe.parallel.launch import ok_values, run_local

WORLD = 3
SENDS = [[1, 2, 0], [0, 1, 2], [2, 0, 1]]
E, D, FF, N = 6, 4, 5, 3
# rank -> its tokens' (token, expert) assignments: rank r sends SENDS[r][p] rows to rank p (experts 2p, 2p + 1)
ASSIGN = {
    0: [(0, 1), (1, 2), (2, 3)],
    1: [(0, 3), (1, 4), (1, 5)],
    2: [(0, 0), (2, 1), (1, 5)],
}
TOL = 1e-12
"""float64, the same operations as the loop up to the order of a few sums: rounding is ~1e-16;
a row in the wrong place is off by O(1)."""


def tag(src: int, dst: int, k: int) -> float:
    return 100.0 * src + 10.0 * dst + k


def expected_received(rank: int) -> list[float]:
    """Rows arrive in source order, each source's rows to ``rank`` in the order it sent them."""
    return [tag(src, rank, k) for src in range(WORLD) for k in range(SENDS[src][rank])]


def slot_coefficient(dst: int, src: int, k: int) -> float:
    """The c that rank ``dst`` puts on its received row k from ``src``: 1000 * dst + its slot."""
    slot = sum(SENDS[s][dst] for s in range(src)) + k
    return 1000.0 * dst + slot


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, assignments, weights and output cotangent (the same on every process)."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(N, D, dtype=torch.float64, generator=g)
    token = torch.tensor([t for t, _ in ASSIGN[rank]])
    expert = torch.tensor([e for _, e in ASSIGN[rank]])
    weight = torch.rand(len(ASSIGN[rank]), dtype=torch.float64, generator=g) + 0.5
    cot = torch.randn(N, D, dtype=torch.float64, generator=g)
    return x, token, expert, weight, cot


def _loop_reference(ws: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Per rank: y[n] = sum_a w_a SwiGLU_{e_a}(x[n]), one assignment at a time, and the gradients
    of sum over ranks of <y, cot> for every rank's x and weights, and the full expert weights."""
    out, loss = {}, 0.0
    w_gate, w_up, w_down = ws
    for r in range(WORLD):
        x, token, expert, weight, cot = _inputs(r)
        x, weight = x.requires_grad_(), weight.requires_grad_()
        rows = [torch.zeros(D, dtype=torch.float64) for _ in range(N)]
        for a in range(token.numel()):
            n, e = int(token[a]), int(expert[a])
            h = F.silu(x[n] @ w_gate[e]) * (x[n] @ w_up[e])
            rows[n] = rows[n] + weight[a] * (h @ w_down[e])
        y = torch.stack(rows)
        loss = loss + (y * cot).sum()
        out[r] = {"y": y.detach(), "x": x, "weight": weight}
    loss.backward()
    return {r: {"y": v["y"], "x_grad": v["x"].grad, "weight_grad": v["weight"].grad} for r, v in out.items()}


def _worker(rank: int, world: int) -> dict[str, float]:
    group = dist.group.WORLD
    res: dict[str, float] = {}
    # 1. the row exchange itself
    send_splits = SENDS[rank]
    recv_splits = [SENDS[src][rank] for src in range(world)]
    sent = [tag(rank, dst, k) for dst in range(world) for k in range(SENDS[rank][dst])]
    x = torch.tensor(sent, dtype=torch.float64)[:, None].repeat(1, 2).requires_grad_()
    out = all_to_all_rows(x, recv_splits, send_splits, group)
    want = torch.tensor(expected_received(rank), dtype=torch.float64)[:, None].repeat(1, 2)
    res["rows/forward"] = float((out - want).abs().max())
    c = 1000.0 * rank + torch.arange(out.shape[0], dtype=torch.float64)
    (out * c[:, None]).sum().backward()
    back = [slot_coefficient(dst, rank, k) for dst in range(world) for k in range(SENDS[rank][dst])]
    res["rows/backward"] = float((x.grad - torch.tensor(back, dtype=torch.float64)[:, None]).abs().max())

    # 2. the expert-parallel data path on these splits
    torch.manual_seed(1)
    full = MoELayer(D, FF, E).double()
    ep = MoELayer(D, FF, E, expert_parallel=ExpertParallel(group)).double()
    load_full_state_dict(ep, full.state_dict())
    ws = [p.detach().clone().requires_grad_() for p in (full.experts.w_gate, full.experts.w_up, full.experts.w_down)]
    ref = _loop_reference(ws)
    x, token, expert, weight, cot = _inputs(rank)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    y = expert_parallel_ffn(x, token, expert, weight, ep.experts, E, group)
    (y * cot).sum().backward()
    start, stop = ep.local_experts
    res["ffn/output"] = float((y - ref[rank]["y"]).abs().max())
    res["ffn/output_scale"] = float(ref[rank]["y"].abs().max())
    res["ffn/input_grad"] = float((x.grad - ref[rank]["x_grad"]).abs().max())
    res["ffn/weight_grad"] = float((weight.grad - ref[rank]["weight_grad"]).abs().max())
    for name, w in zip(("w_gate", "w_up", "w_down"), ws):
        res[f"ffn/{name}_grad"] = float((getattr(ep.experts, name).grad - w.grad[start:stop]).abs().max())
    return res


def test_uneven_splits_that_differ_from_the_received_ones():
    results = ok_values(run_local(_worker, WORLD, timeout_s=120.0))
    for rank, res in enumerate(results):
        assert res["ffn/output_scale"] > 0.1, res  # the comparison is not of zeros
        bad = {k: v for k, v in res.items() if not k.endswith("_scale") and v > TOL}
        assert not bad, f"rank {rank}: max |difference| above {TOL}: {bad}"
