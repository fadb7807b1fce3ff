"""Per-rank peak memory of training steps when the model is built on the meta device, and what
activation checkpointing and torch.compile change.

    python experiments/bench_memory.py --quick                 # small model, about 3 min on 2 cores
    python experiments/bench_memory.py --out experiments/results/bench_memory-2026-12-01-cpu2

Three parts, every measurement in its own spawned process (``moe.parallel.launch.run_local``,
gloo, one thread each), so a peak is that configuration's alone:

1. **Peak memory per rank** for 1, 2 and 4 ranks (FSDP2 over all of them, ``dp_shard=W``) on
   the 268M-parameter configuration (``--preset small --d-model 1024 --n-layers 16 --n-heads 16
   --moe-d-ff 512 --num-experts 8``): ``--steps`` training steps (forward, backward, AdamW)
   on a global batch of ``--batch`` random sequences of ``--seq`` tokens split over the
   ranks. The model is built on the meta device, sharded (FSDP2 units: each block's attention
   and feed-forward, then the block, ``moe.parallel.mesh.fsdp_units``), then materialised
   shard by shard (``moe.parallel.materialize``); ``--whole-first`` adds the old way at the largest world
   size (every rank builds the whole model, then shards it) for comparison. Per rank: the
   peak resident set size (``ru_maxrss``; on CUDA the allocator's peak instead), the
   resident size before the model exists (the interpreter and torch), and the parameter,
   gradient and optimizer bytes it holds (``rank_state_bytes``). The ratio that matters is
   the largest per-rank peak at the largest world size over the single-process peak.
2. **Activation checkpointing** (``none | full | selective``) against sequence length, one
   process, the small preset: how far the second step's peak rises above its start (model
   and AdamW state already there): the activations, the gradients and the backward's
   transients (the peak is reset before that step: ``/proc/self/clear_refs`` on CPU).
3. **torch.compile / eager step time** on CPU, one process and FSDP2 over 2 processes, the
   ``--ac-model``: median step time after the first (compiling) steps. While compiled, the
   torch data path is one opaque operator (``torch.ops.moe_kernels.sorted_moe_ffn``: the eager sorted
   path with output shapes known from its inputs), so the expert FLOPs are the eager ones.

On CPU, RSS counts what the allocator holds, and glibc keeps freed memory for reuse: the
benchmark sets ``MALLOC_MMAP_THRESHOLD_`` (64 KiB) for its processes, so every tensor larger
than that is its own mapping, returned to the system when freed, and calls ``malloc_trim``
before a step's peak is reset. Peaks then follow the live tensors closely (upper bounds still).
``--glibc-default`` leaves glibc as it is: the resident sizes a user's run shows, where memory
freed after building the whole model stays counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.model import MoETransformer, preset  # noqa: E402
from moe.parallel import rank_state_bytes  # noqa: E402
from moe.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from moe.parallel.compile import compile_blocks  # noqa: E402
from moe.parallel.launch import ok_values, run_local  # noqa: E402
from moe.parallel.materialize import materialize, parameters_on_meta  # noqa: E402
from moe.parallel.memory import current_bytes, peak_bytes, reset_peak  # noqa: E402
from moe.parallel.mesh import Layout, ParallelMesh, fsdp_units, mixed_precision, shard_model  # noqa: E402

MODEL_268M = dict(d_model=1024, n_layers=16, n_heads=16, moe_d_ff=512, num_experts=8)
MIB = 2**20


def build(model_kw: dict, world: int, whole_first: bool, ac: str, compiled: bool, device: torch.device):
    """The model of ``model_kw`` placed on ``world`` ranks (FSDP2 when > 1)."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # out-of-place blocks
    cfg = preset("small", **model_kw)
    pmesh = ParallelMesh(Layout.from_world(world), device.type) if world > 1 else None
    if whole_first:
        model = MoETransformer(cfg, init_seed=0).to(device)
    else:
        with parameters_on_meta():
            model = MoETransformer(cfg, init_seed=0)
    if compiled:
        compile_blocks(model.blocks)
    apply_activation_checkpointing(model.blocks, ac)  # after compiling: see moe.parallel.activation_checkpointing
    if pmesh is not None:
        shard_model(model, pmesh, fsdp_units(list(model.blocks)), mixed_precision(device))
    if not whole_first:
        materialize(model, device, model.init_parameter)
    return model


def train_steps(rank: int, world: int, spec: dict) -> dict:
    """Build as ``spec`` says, run its steps; this rank's memory, state bytes and step times."""
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    before = current_bytes(device)
    model = build(
        spec["model"], world, spec.get("whole_first", False), spec.get("ac", "none"), spec.get("compile", False), device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    local = spec["batch"] // world
    times, state, peak = [], {}, 0
    for step in range(spec["steps"]):
        last = step == spec["steps"] - 1
        if last:  # the last step alone: its peak above what it starts from (the activations and transients)
            peak = peak_bytes(device)
            reset_peak(device)
            start = current_bytes(device)
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        idx = torch.randint(0, 256, (local, spec["seq"] + 1), generator=gen).to(device)
        t0 = time.perf_counter()
        out = model(idx[:, :-1], idx[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        if last:
            state = rank_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    step_peak = peak_bytes(device)
    return {
        "peak": max(peak, step_peak),
        "before_model": before,
        "last_step_above_start": step_peak - start,
        "state": state,
        "step_s": times,
    }


def run(world: int, spec: dict) -> list[dict]:
    return ok_values(run_local(train_steps, world, spec, timeout_s=1800, pg_timeout_s=900))


def memory_part(args, model_kw: dict) -> dict:
    spec = dict(model=model_kw, batch=args.batch, seq=args.seq, steps=args.steps)
    rows = {}
    for world in args.ranks:
        rows[f"meta_w{world}"] = run(world, spec)
        print(
            f"  {world} rank(s), meta build: largest peak {max(r['peak'] for r in rows[f'meta_w{world}']) / MIB:,.0f} MiB",
            flush=True,
        )
    if args.whole_first:
        world = max(args.ranks)
        rows[f"whole_w{world}"] = run(world, {**spec, "whole_first": True})
        print(
            f"  {world} ranks, whole model first: largest peak "
            f"{max(r['peak'] for r in rows[f'whole_w{world}']) / MIB:,.0f} MiB",
            flush=True,
        )
    single = max(r["peak"] for r in rows[f"meta_w{min(args.ranks)}"])
    ratios = {name: max(r["peak"] for r in ranks) / single for name, ranks in rows.items()}
    return {"runs": rows, "single_peak": single, "peak_ratio_to_single": ratios}


def ac_part(args, model_kw: dict) -> dict:
    out = {}
    for seq in args.ac_seqs:
        for mode in ("none", "full", "selective"):
            (r,) = run(1, dict(model=model_kw, batch=args.ac_batch, seq=seq, steps=2, ac=mode))
            out[f"{mode}_T{seq}"] = {"activation_peak": r["last_step_above_start"], "step_s": r["step_s"]}
            print(
                f"  T={seq} {mode}: the second step peaks {r['last_step_above_start'] / MIB:,.0f} MiB above its start",
                flush=True,
            )
    return out


def compile_part(args, model_kw: dict) -> dict:
    out = {}
    for world in (1, 2):
        timing = {}
        for compiled in (False, True):
            spec = dict(
                model=model_kw,
                batch=args.ac_batch,
                seq=args.compile_seq,
                steps=args.compile_warmup + args.compile_steps,
                compile=compiled,
            )
            ranks = run(world, spec)
            timing[compiled] = max(statistics.median(r["step_s"][args.compile_warmup :]) for r in ranks)
        out[f"w{world}"] = {"eager_s": timing[False], "compiled_s": timing[True], "ratio": timing[True] / timing[False]}
        print(
            f"  {world} process(es): compiled/eager step time {out[f'w{world}']['ratio']:.2f} "
            f"({timing[True]:.3f} s vs {timing[False]:.3f} s)",
            flush=True,
        )
    return out


def markdown(res: dict) -> str:
    lines = [
        f"# bench_memory ({res['date']}, {res['device']})",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Model: {res['model']} ({res['num_parameters']:,} parameters); memory steps on a global batch of "
        f"{res['args']['batch']} x {res['args']['seq']} tokens; malloc: "
        + ("glibc default" if res["args"].get("glibc_default") else "MALLOC_MMAP_THRESHOLD_=65536")
        + ".",
        "",
        "| run | rank | peak MiB | before model MiB | params MiB | grads MiB | optimizer MiB | peak / single |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mem = res["memory"]
    for name, ranks in mem["runs"].items():
        for rank, r in enumerate(ranks):
            s = r["state"]
            lines.append(
                f"| {name} | {rank} | {r['peak'] / MIB:,.0f} | {r['before_model'] / MIB:,.0f} | "
                f"{s['params'] / MIB:,.0f} | {s['grads'] / MIB:,.0f} | {s['optimizer'] / MIB:,.0f} | "
                f"{r['peak'] / mem['single_peak']:.3f} |"
            )
    lines += [
        "",
        "Largest per-rank peak over the single-process peak: "
        + ", ".join(f"{k} {v:.3f}" for k, v in mem["peak_ratio_to_single"].items()),
        "",
    ]
    if res.get("activation_checkpointing"):
        lines += [
            f"Activation checkpointing ({res['ac_model']}, batch {res['args']['ac_batch']}): the second step's "
            "peak above its start, MiB",
            "",
            "| T | none | full | selective |",
            "|---|---|---|---|",
        ]
        ac = res["activation_checkpointing"]
        for seq in res["args"]["ac_seqs"]:
            lines.append(
                f"| {seq} | "
                + " | ".join(
                    f"{ac[f'{m}_T{seq}']['activation_peak'] / MIB:,.0f}" for m in ("none", "full", "selective")
                )
                + " |"
            )
        lines.append("")
    if res.get("compile"):
        lines += [
            f"torch.compile ({res['ac_model']}, batch {res['args']['ac_batch']} x {res['args']['compile_seq']}): "
            "median step time after the compiling steps",
            "",
            "| processes | eager s | compiled s | compiled / eager |",
            "|---|---|---|---|",
        ]
        for name, c in res["compile"].items():
            lines.append(f"| {name[1:]} | {c['eager_s']:.3f} | {c['compiled_s']:.3f} | {c['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small preset everywhere, shorter sweeps")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8, help="global batch of the memory steps")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--whole-first", action="store_true", help="also the old build (whole model on every rank first)")
    p.add_argument("--ac-seqs", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--ac-batch", type=int, default=8)
    p.add_argument("--compile-seq", type=int, default=128)
    p.add_argument("--compile-warmup", type=int, default=2)
    p.add_argument("--compile-steps", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["memory", "ac", "compile"])
    p.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's malloc as it is (RSS then includes freed memory glibc keeps: what a user sees)",
    )
    p.add_argument("--out", help="write <out>.json and <out>.md")
    args = p.parse_args()
    if not args.glibc_default:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # inherited by the spawned ranks
    model_kw = {} if args.quick else MODEL_268M
    ac_kw: dict = {}  # parts 2 and 3 run the small preset as it is (d=256, 4 blocks, 8 experts)
    if args.quick:
        args.ac_seqs = args.ac_seqs[:2]
    with torch.device("meta"):
        num_params = MoETransformer(preset("small", **model_kw), init_seed=0).num_parameters()
    res = {
        "date": date.today().isoformat(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "command": " ".join(["python", *sys.argv]),
        "args": vars(args),
        "model": {"preset": "small", **model_kw},
        "num_parameters": num_params,
        "ac_model": {"preset": "small", **ac_kw},
    }
    if "memory" not in args.skip:
        print("peak memory per rank:", flush=True)
        res["memory"] = memory_part(args, model_kw)
    if "ac" not in args.skip:
        print("activation checkpointing:", flush=True)
        res["activation_checkpointing"] = ac_part(args, ac_kw)
    if "compile" not in args.skip:
        print("torch.compile:", flush=True)
        res["compile"] = compile_part(args, ac_kw)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
        if "memory" in res:
            Path(f"{args.out}.md").write_text(markdown(res))
    print(json.dumps(res.get("memory", {}).get("peak_ratio_to_single", {})))


if __name__ == "__main__":
    main()
