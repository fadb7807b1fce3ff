"""Training step of the MoE model on every DeviceMesh layout: step time, exposed communication,
and parameter + gradient + optimizer bytes per rank against one process.

    python experiments/bench_parallel.py                              # CPU: 1, 2 and 4 gloo processes
    python experiments/bench_parallel.py --preset small --batch-size 16 --iters 5
    python experiments/bench_parallel.py --out experiments/results/bench_parallel-2026-11-29-cpu2

One step = forward, backward, gradient clipping and AdamW step of ``moe.training``'s model on
a fixed *global* batch split over the W ranks (strong scaling), with the layout's FSDP2 /
expert-parallel sharding, the model placed as ``train()`` places it (``place_model`` of
``moe.training.placement``). Per layout (``--dp-replicate R --expert-parallel P``; FSDP2 over
the rest) and world size:

* step ms: median over ``--iters`` steps after ``--warmup`` of the slowest rank;
* compute ms: the same rank's step on its local batch with the *unsharded* single-process
  model (no communication at all), measured in the same process just before: the work a rank
  cannot avoid;
* exposed comm ms: step - compute, i.e. communication and waiting not hidden behind compute
  (on CPU, gloo collectives block the calling thread, so nearly all of it is exposed);
* bytes/rank: parameters + gradients + AdamW state this rank holds (largest rank), and its
  ratio to the single-process figure (1/W for plain FSDP2).

With fewer free cores than processes (the 2-core machine these results come from) the
processes share cores, so step times measure overhead, not speed-up; bytes are exact.

Pipeline layouts (``--pipeline-microbatches``, on ``--pipeline-world`` processes, one stage
each, the model deepened to ``--pipeline-layers`` blocks so interleaved 1F1B has two stages per
rank): per schedule (GPipe, 1F1B, interleaved 1F1B) and microbatch count M, the step time and
the **measured bubble**, 1 - busy/step, where busy is the time the rank spent inside its
stages' forward and backward chunks (``forward_one_chunk`` / ``backward_one_chunk`` timed,
everything else is waiting for a neighbour or the optimizer), averaged over ranks; against
the theoretical idle fraction with equal stage times, (S-1)/(M+S-1) for GPipe and 1F1B and
(S-1)/(V*M+S-1) for interleaved 1F1B with V stages per rank. The optimizer step is outside
the pipeline and counts as busy; with as many free cores as processes the ranks do not compete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import Clocks  # noqa: E402
from moe.parallel import clip_grad_norm_, rank_state_bytes  # noqa: E402
from moe.parallel.launch import ok_values, run_local  # noqa: E402
from moe.parallel.pipeline import SCHEDULES, Pipeline, StageModel, bubble_fraction, sync_tied_gradient, virtual_stages  # noqa: E402
from moe.training import TrainConfig, build_model, model_config  # noqa: E402
from moe.training.batches import local_batch  # noqa: E402
from moe.training.distributed import DistInfo  # noqa: E402
from moe.training.optim import make_optimizer  # noqa: E402
from moe.training.placement import place_model  # noqa: E402


def layouts_for(world: int, num_experts: int) -> list[tuple[int, int]]:
    """Every (R, P) with R*P dividing ``world`` and P dividing ``num_experts``."""
    return [
        (r, p)
        for r in range(1, world + 1)
        for p in range(1, world + 1)
        if world % (r * p) == 0 and num_experts % p == 0
    ]


def _timed_steps(model, optimizer, corpus, cfg: TrainConfig, info: DistInfo, n: int) -> list[float]:
    times = []
    for step in range(1, n + 1):
        idx_BT, targets_BT = local_batch(corpus, cfg.data, cfg.seed, step, info.device, (info.rank, info.world_size))
        if dist.is_initialized():
            dist.barrier()
        clocks = Clocks()
        out = model(idx_BT, targets_BT)
        (out.loss + out.aux_loss).backward()
        clip_grad_norm_(model, cfg.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(clocks.lap()[0])
    return times


def bench_rank(rank: int, world: int, opts: dict) -> dict:
    cfg = TrainConfig.flat(
        preset=opts["preset"],
        batch_size=opts["batch_size"],
        seq_len=opts["seq_len"],
        max_bytes=opts["max_bytes"],
        progress=False,
    )
    corpus = cfg.data.load()
    mcfg = model_config(cfg.model, corpus.vocab_size)
    device = torch.device("cpu")
    info = DistInfo(rank, world, rank, device)
    n = opts["warmup"] + opts["iters"]

    plain = build_model(mcfg, cfg.seed, device)
    plain_opt = make_optimizer(plain, cfg.optimizer)
    compute = statistics.median(_timed_steps(plain, plain_opt, corpus, cfg, info, n)[opts["warmup"] :])
    rows = {}
    for r, p in layouts_for(world, mcfg.num_experts) if world > 1 else [(1, 1)]:
        # placed as train() places it: the mesh, expert parallelism, FSDP2 units, sharded initialisation
        place, _ = place_model(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=r, expert_parallel=p)),
            mcfg.num_experts,
            lambda ep: build_model(mcfg, cfg.seed, device, ep, materialized=False),
            info,
        )
        model, layout = place.model, place.layout
        optimizer = make_optimizer(model, cfg.optimizer)
        step = statistics.median(_timed_steps(model, optimizer, corpus, cfg, info, n)[opts["warmup"] :])
        mine = torch.tensor([step, compute, float(rank_state_bytes(model, optimizer)["total"])], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        slowest = max(every, key=lambda v: float(v[0]))
        rows[str(layout)] = {
            "world": world,
            "dp_replicate": r,
            "dp_shard": layout.dp_shard,
            "expert_parallel": p,
            "step_s": float(slowest[0]),
            "compute_s": float(slowest[1]),
            "exposed_comm_s": max(float(slowest[0] - slowest[1]), 0.0),
            "bytes_per_rank": int(max(float(v[2]) for v in every)),
        }
    return rows


def _timed(fn, total: list[float]):
    def wrapper(*args, **kwargs):
        clocks = Clocks()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += clocks.lap()[0]

    return wrapper


def bench_pipeline_rank(rank: int, world: int, opts: dict) -> list[dict]:
    """Every (schedule, M) of ``opts`` on ``world`` pipeline ranks: step and busy time."""
    cfg = TrainConfig.flat(
        preset=opts["preset"],
        batch_size=opts["batch_size"],
        seq_len=opts["seq_len"],
        max_bytes=opts["max_bytes"],
        progress=False,
        model={"n_layers": opts["pipeline_layers"]},
    )
    corpus = cfg.data.load()
    mcfg = model_config(cfg.model, corpus.vocab_size)
    device = torch.device("cpu")
    info = DistInfo(rank, world, rank, device)
    tied = dist.new_group([0, world - 1])
    rows = []
    for schedule in SCHEDULES:
        v = virtual_stages(schedule)
        for m in opts["pipeline_microbatches"]:
            if cfg.data.batch_size % m or (schedule != "gpipe" and m % world):
                continue  # a microbatch count this schedule refuses
            stage = StageModel(build_model(mcfg, cfg.seed, device), rank, world, v)
            pipe = Pipeline(stage, schedule, m, (cfg.data.batch_size // m, cfg.data.seq_len), dist.group.WORLD, device)
            busy = [0.0]
            for st in pipe.stages:
                st.forward_one_chunk = _timed(st.forward_one_chunk, busy)
                st.backward_one_chunk = _timed(st.backward_one_chunk, busy)
            optimizer = make_optimizer(stage, cfg.optimizer)
            steps, busies = [], []
            for step in range(1, opts["warmup"] + opts["iters"] + 1):
                idx_BT, targets_BT = local_batch(corpus, cfg.data, cfg.seed, step, info.device)
                dist.barrier()
                busy[0] = 0.0
                clocks = Clocks()
                pipe.step(idx_BT, targets_BT)
                stage.pop_records()
                sync_tied_gradient(stage.tied_weight(), tied)
                pipelined = clocks.lap()[0]
                clip_grad_norm_(stage, cfg.optimizer.grad_clip, dist.group.WORLD, stage.uncounted())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                optimizer_s = clocks.lap()[0]
                steps.append(pipelined + optimizer_s)
                busies.append(busy[0] + optimizer_s)
            keep = slice(opts["warmup"], None)
            mine = torch.tensor([statistics.median(steps[keep]), statistics.median(busies[keep])], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            step_s = max(float(e[0]) for e in every)
            rows.append(
                {
                    "world": world,
                    "schedule": schedule,
                    "microbatches": m,
                    "virtual_stages": v,
                    "step_s": step_s,
                    "busy_s": [float(e[1]) for e in every],
                    "bubble": statistics.mean(1 - float(e[1]) / float(e[0]) for e in every),
                    "bubble_theory": bubble_fraction(world, v * m),
                }
            )
    return rows


def format_pipeline_table(rows: list[dict]) -> str:
    lines = [
        "| S (ranks) | schedule | M | step ms | busy ms per rank | bubble measured | bubble theory |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        busy = " / ".join(f"{b * 1e3:.0f}" for b in r["busy_s"])
        lines.append(
            f"| {r['world']} | {r['schedule']} | {r['microbatches']} | {r['step_s'] * 1e3:.1f} | {busy} | "
            f"{r['bubble']:.2f} | {r['bubble_theory']:.2f} |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict], single_bytes: int) -> str:
    lines = [
        "| W | R (replicate) | S (shard) | P (expert) | step ms | compute ms | exposed comm ms | bytes/rank | vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['dp_replicate']} | {r['dp_shard']} | {r['expert_parallel']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['compute_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:.1f} | {r['bytes_per_rank']:,} | "
            f"{r['bytes_per_rank'] / single_bytes:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8, help="global sequences per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-bytes", type=int, default=200_000)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pipeline-world", type=int, default=2, help="pipeline ranks (0: no pipeline layouts)")
    parser.add_argument("--pipeline-microbatches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--pipeline-layers", type=int, default=4, help="blocks of the pipelined model")
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    for name in ("batch_size", "seq_len", "iters", "pipeline_layers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.pipeline_world and args.pipeline_layers < 2 * args.pipeline_world:
        parser.error(
            "--pipeline-layers must be at least twice --pipeline-world (interleaved 1F1B: two stages per rank)"
        )
    opts = {
        k: getattr(args, k)
        for k in (
            "preset",
            "batch_size",
            "seq_len",
            "max_bytes",
            "iters",
            "warmup",
            "pipeline_microbatches",
            "pipeline_layers",
        )
    }
    rows = []
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning"  # the spawned ranks: FSDP2 / DeviceMesh notices
    for world in args.world_sizes:
        if args.batch_size % world:
            raise SystemExit(f"--batch-size {args.batch_size} must be divisible by every world size ({world})")
        clocks = Clocks()
        res = ok_values(run_local(bench_rank, world, opts, timeout_s=1800.0, pg_timeout_s=600.0))[0]
        rows.extend(res.values())
        print(f"W={world}: {len(res)} layouts ({clocks.lap()[0]:.0f}s)", flush=True)
    single = next(r for r in rows if r["world"] == 1) if 1 in args.world_sizes else rows[0]
    header = (
        f"preset {args.preset}, global batch {args.batch_size} x {args.seq_len} tokens, "
        f"median of {args.iters} steps after {args.warmup}, gloo, {os.cpu_count()} CPU cores, 1 thread per process"
    )
    table = format_table(rows, single["bytes_per_rank"])
    pipeline_rows, pipeline_table = [], ""
    if args.pipeline_world:
        clocks = Clocks()
        pipeline_rows = ok_values(
            run_local(bench_pipeline_rank, args.pipeline_world, opts, timeout_s=1800.0, pg_timeout_s=600.0)
        )[0]
        print(f"pipeline, S={args.pipeline_world}: {len(pipeline_rows)} layouts ({clocks.lap()[0]:.0f}s)")
        pipeline_table = (
            f"\n\nPipeline, {args.pipeline_layers} blocks, global batch {args.batch_size}:\n\n"
            + format_pipeline_table(pipeline_rows)
        )
    print(f"\n{header}\n\n{table}{pipeline_table}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(
            json.dumps({"setup": header, "rows": rows, "pipeline_rows": pipeline_rows}, indent=1)
        )
        out.with_suffix(".md").write_text(f"{header}\n\n{table}{pipeline_table}\n")


if __name__ == "__main__":
    main()
