"""Bytes an expert-parallel MoE layer sends per token: group-limited routing (DeepSeek-V3's
node-limited top-k, the groups mapped to ranks) against plain top-k, through the
per-assignment exchange and the rank-deduplicated one.

    python experiments/bench_group_routing.py                      # 4 gloo processes, two shapes
    python experiments/bench_group_routing.py --ranks 4 --tokens 2048 --d-model 256 --out /tmp/g

Every rank routes its own ``--tokens`` tokens (random, with a shared mean direction as a
residual stream has) with a ``topk`` router of sigmoid scores (random gate, std 1/sqrt(D)),
then runs one forward and backward of the expert-parallel layer. Every ``all_to_all_single``
input is counted (rows of tokens and of expert outputs, the counts, and the deduplicated
path's per-assignment indices and weights), summed over the ranks and divided by the tokens
of all ranks: bytes sent per token, forward and backward. "ranks/token" is the mean number of
distinct ranks holding a token's k experts (what the deduplicated exchange sends rows to).
Group-limited rows use G = P groups (group g = the experts of rank g) and keep M of them, so
a token reaches at most M ranks. The two exchanges' outputs are compared (they agree to
rounding). Results: ``--out`` + ``.json`` and ``.md`` (default
experiments/results/bench_group_routing-<date>-cpu).
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from moe.layer import MoELayer
from moe.parallel import ExpertParallel, load_full_state_dict
from moe.parallel.launch import ok_values, run_local

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(32, 4), (64, 8)]
"""(experts E, top-k k) of the rows: DeepSeek-V3 routes 8 of 256 experts, 8 groups, 4 kept."""


def count_bytes(log: list[int]):
    """(the real all_to_all_single, a wrapper adding each call's input bytes to ``log``)."""
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        log.append(input.numel() * input.element_size())
        return real(output, input, *args, **kwargs)

    return real, counting


def measure(rank: int, world: int, layer_opts: dict, x_ND: torch.Tensor, num_experts: int, dedup: bool) -> dict:
    torch.manual_seed(0)
    full = MoELayer(x_ND.shape[1], x_ND.shape[1], num_experts, router="topk", **layer_opts)
    layer = MoELayer(
        x_ND.shape[1],
        x_ND.shape[1],
        num_experts,
        router="topk",
        expert_parallel=ExpertParallel(dist.group.WORLD, dedup=dedup),
        **layer_opts,
    )
    load_full_state_dict(layer, full.state_dict())
    forward, backward = [], []
    real = dist.all_to_all_single
    try:
        dist.all_to_all_single = count_bytes(forward)[1]
        y_BTD, routing = layer(x_ND.unsqueeze(0), return_routing=True)
        dist.all_to_all_single = count_bytes(backward)[1]
        (y_BTD.square().mean() + routing.aux_loss).backward()
    finally:
        dist.all_to_all_single = real
    rank_NK = routing.expert.view(x_ND.shape[0], -1) // (num_experts // world)
    distinct_N = torch.stack([(rank_NK == p).any(1) for p in range(world)], 1).sum(1)
    sums = torch.tensor([sum(forward), sum(backward), float(distinct_N.sum()), float(x_ND.shape[0])])
    dist.all_reduce(sums)
    tokens = sums[3].item()
    return {
        "forward_bytes_per_token": sums[0].item() / tokens,
        "backward_bytes_per_token": sums[1].item() / tokens,
        "ranks_per_token": sums[2].item() / tokens,
        "output": y_BTD.detach(),
    }


def worker(rank: int, world: int, tokens: int, d_model: int) -> list[dict]:
    gen = torch.Generator().manual_seed(100 + rank)
    x_ND = torch.randn(tokens, d_model, generator=gen) + 0.5
    rows = []
    for num_experts, k in SHAPES:
        routings = {"plain top-k": {}}
        for m in range(1, world):
            if k <= m * num_experts // world:
                routings[f"groups {world}, keep {m}"] = {"num_expert_groups": world, "num_limited_groups": m}
        for label, groups in routings.items():
            opts = {"top_k": k, "gate": "sigmoid", **groups}
            per_assignment = measure(rank, world, opts, x_ND, num_experts, dedup=False)
            dedup = measure(rank, world, opts, x_ND, num_experts, dedup=True)
            diff = (per_assignment.pop("output") - dedup.pop("output")).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "experts": num_experts,
                    "top_k": k,
                    "routing": label,
                    "per_assignment": per_assignment,
                    "dedup": dedup,
                    "max_output_diff": diff.item(),
                }
            )
    return rows


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Bytes per token of the expert-parallel exchange ({c['date']})",
        "",
        f"{c['ranks']} gloo processes, {c['tokens']} tokens per rank, D = {c['d_model']} (fp32 rows of "
        f"{4 * c['d_model']} bytes), topk router with sigmoid scores; forward + backward of one layer; "
        "bytes of every all_to_all_single input, summed over ranks, per token. "
        f"`{c['command']}`",
        "",
        "| E | k | routing | ranks/token | per-assignment fwd+bwd B/token | dedup fwd+bwd B/token "
        "| dedup vs per-assignment | vs plain top-k (dedup) | max output diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {}
    for r in result["rows"]:
        pa = r["per_assignment"]["forward_bytes_per_token"] + r["per_assignment"]["backward_bytes_per_token"]
        dd = r["dedup"]["forward_bytes_per_token"] + r["dedup"]["backward_bytes_per_token"]
        if r["routing"] == "plain top-k":
            plain[r["experts"]] = dd
        lines.append(
            f"| {r['experts']} | {r['top_k']} | {r['routing']} | {r['dedup']['ranks_per_token']:.2f} | {pa:.0f} | "
            f"{dd:.0f} | {dd / pa:.3f} | {dd / plain[r['experts']]:.3f} | {r['max_output_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--out", default=None, help="path without suffix (default: experiments/results/...)")
    args = parser.parse_args()
    if any(e % args.ranks for e, _ in SHAPES):
        parser.error(f"--ranks must divide the expert counts {[e for e, _ in SHAPES]}")
    today = date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "experiments" / "results" / f"bench_group_routing-{today}-cpu"
    rows = ok_values(run_local(worker, args.ranks, args.tokens, args.d_model, timeout_s=1800))[0]
    command = f"python experiments/bench_group_routing.py --ranks {args.ranks} --tokens {args.tokens} --d-model {args.d_model}"
    config = {"date": today, "ranks": args.ranks, "tokens": args.tokens, "d_model": args.d_model, "command": command}
    result = {"config": config, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
