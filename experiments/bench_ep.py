"""Expert-parallel MoE layer: per-step time split into routing, exchange, expert compute and combine.

    python experiments/bench_ep.py                                   # CPU: 1, 2 and 4 gloo processes
    python experiments/bench_ep.py --world-sizes 1 2 --tokens 4096 --iters 10
    torchrun --standalone --nproc-per-node 1 experiments/bench_ep.py --device cuda   # GPUs (NCCL), one row
    torchrun --standalone --nproc-per-node 8 experiments/bench_ep.py --device cuda --tokens 65536

One step = forward + backward of one MoE layer (topk router) on a fixed *global* batch of
``--tokens`` tokens split evenly over the P ranks (strong scaling), each phase summed over
forward and backward:

* routing: the router (gate, top-k, aux loss) and the local dispatch (sort by expert, gather
  rows), with their backward;
* exchange: the count all-to-all and both row all-to-alls, forward and backward;
* experts: the local experts on the received rows (the layer's backend);
* combine: weighting the returned rows and summing them into tokens.

Every row is the slowest rank's (largest median step time; ranks wait for each other at
the exchanges, so waiting shows up as exchange time), median over ``--iters`` steps after
``--warmup``; the phases do not add up to the step exactly (the loss, barriers and
autograd bookkeeping are in no phase). "single" is the
plain single-process MoELayer (no process group) on the same tokens and weights, measured
in the same run (in the first row's process, with its threads): the baseline every "vs
single" ratio refers to. On CPU each process runs ``--threads`` torch threads (default 1,
so P processes use up to P cores); with fewer free cores than processes the parallel rows
measure overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import Clocks, interleaved  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from moe.parallel import ExpertParallel, PhaseTimer, load_full_state_dict  # noqa: E402
from moe.parallel.exchange import BACKWARD_PHASES  # noqa: E402
from moe.parallel.launch import ok_values, run_local  # noqa: E402

PHASES = ("routing", "exchange", "experts", "combine")


def step_phases(layer: MoELayer, x_ND: torch.Tensor, timer: PhaseTimer) -> dict[str, float]:
    """One timed forward + backward of an expert-parallel layer: seconds per phase and total."""
    timer.reset()
    x_ND = x_ND.detach().requires_grad_()
    dist.barrier()
    start = timer.now()
    with timer.phase("router"):
        routing = layer.router(x_ND.unsqueeze(0))
    y_ND = layer.expert_parallel(
        x_ND, routing.token, routing.expert, routing.weight, layer.experts, layer.num_experts, layer.backend, timer
    )
    loss = y_ND.float().square().mean() + routing.aux_loss
    mid = timer.now()
    loss.backward()
    end = timer.now()
    fwd, bwd = timer.forward, timer.backward_split(mid, end, BACKWARD_PHASES)
    return {
        "routing": fwd["router"] + fwd["dispatch"] + bwd.get("dispatch", 0.0),
        "exchange": fwd["exchange"] + bwd.get("exchange", 0.0),
        "experts": fwd["experts"] + bwd.get("experts", 0.0),
        "combine": fwd["combine"] + bwd.get("combine", 0.0),
        "total": end - start,
    }


def bench_rank(rank: int, world: int, opts: dict) -> dict[str, float]:
    """Median per-phase seconds of the slowest rank (on every rank), plus the baseline on rank 0."""
    device = torch.device(opts["device"])
    torch.manual_seed(0)
    kwargs = dict(router="topk", top_k=opts["top_k"], backend=opts["backend"])
    full = MoELayer(opts["d_model"], opts["d_ff"], opts["experts"], **kwargs)
    ep = MoELayer(
        opts["d_model"], opts["d_ff"], opts["experts"], expert_parallel=ExpertParallel(dist.group.WORLD), **kwargs
    )
    load_full_state_dict(ep, full.state_dict())
    full, ep = full.to(device), ep.to(device)
    n_local = opts["tokens"] // world
    x_ND = torch.randn(opts["tokens"], opts["d_model"], generator=torch.Generator().manual_seed(1)).to(device)
    x_local = x_ND[rank * n_local : (rank + 1) * n_local]
    timer = PhaseTimer(device)
    samples = [step_phases(ep, x_local, timer) for _ in range(opts["warmup"] + opts["iters"])][opts["warmup"] :]
    out = {k: statistics.median(s[k] for s in samples) for k in (*PHASES, "total")}
    if rank == 0 and opts["baseline"]:

        def single() -> None:
            y, routing = full(x_ND.detach().requires_grad_().unsqueeze(0), return_routing=True)
            (y.float().square().mean() + routing.aux_loss).backward()

        sync = torch.cuda.synchronize if device.type == "cuda" else None
        samples = interleaved({"single": single}, opts["iters"], warmup=opts["warmup"], sync=sync)
        out["single"] = samples["single"].median("wall")
    keys = (*PHASES, "total")
    mine = torch.tensor([out[k] for k in keys], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    slowest = max(every, key=lambda v: float(v[-1]))
    out.update(zip(keys, slowest.tolist()))
    return out


def format_table(rows: list[tuple[str, int, dict]], baseline: float) -> str:
    head = f"| device | P | step ms | {' | '.join(f'{p} ms' for p in PHASES)} | vs single |"
    lines = [head, "|" + "---|" * (len(PHASES) + 4)]
    lines.append(f"| {rows[0][0]} | single | {baseline * 1e3:.1f} | " + " | ".join("-" for _ in PHASES) + " | 1.00x |")
    for device, world, r in rows:
        cells = " | ".join(f"{r[p] * 1e3:.1f}" for p in PHASES)
        lines.append(f"| {device} | {world} | {r['total'] * 1e3:.1f} | {cells} | {baseline / r['total']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="CPU process counts to run")
    parser.add_argument("--tokens", type=int, default=8192, help="global tokens per step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per CPU process (0: cores // P; default 1)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (spawns gloo processes) or cuda (run under torchrun)")
    parser.add_argument("--backend", default="torch", help="MoE data path for the local experts: torch | triton | auto")
    args = parser.parse_args()
    for name in ("tokens", "d_model", "d_ff", "experts", "iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    opts = {
        k: getattr(args, k) for k in ("tokens", "d_model", "d_ff", "experts", "top_k", "iters", "warmup", "backend")
    }

    if args.device.startswith("cuda"):
        # Under torchrun: one row for this world size, NCCL, one GPU per rank.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        _check_divisible(args, [world])
        res = bench_rank(rank, world, {**opts, "device": f"cuda:{local_rank}", "baseline": True})
        if rank == 0:
            print(format_table([(torch.cuda.get_device_name(), world, res)], res["single"]))
        dist.destroy_process_group()
        return

    _check_divisible(args, args.world_sizes)
    cores = os.cpu_count() or 1
    rows, baseline = [], None
    for world in args.world_sizes:
        threads = args.threads or max(1, cores // world)
        clocks = Clocks()
        res = ok_values(
            run_local(
                bench_rank,
                world,
                {**opts, "device": "cpu", "baseline": baseline is None},
                timeout_s=1800.0,
                pg_timeout_s=600.0,
                threads=threads,
            )
        )[0]
        baseline = res.get("single", baseline)
        rows.append((f"cpu x{threads} thr", world, res))
        print(f"P={world}: {res['total'] * 1e3:.1f} ms/step ({clocks.lap()[0]:.0f}s)", flush=True)
    print(
        f"\nMoE layer fwd+bwd, {args.tokens} global tokens, D={args.d_model}, F={args.d_ff}, E={args.experts}, "
        f"top-{args.top_k}, backend {args.backend}, {cores} CPU cores\n"
    )
    print(format_table(rows, baseline))


def _check_divisible(args: argparse.Namespace, worlds: list[int]) -> None:
    for world in worlds:
        if world <= 0 or args.experts % world or args.tokens % world:
            raise SystemExit(
                f"P={world} must be positive and divide --experts={args.experts} and --tokens={args.tokens}"
            )


if __name__ == "__main__":
    main()
