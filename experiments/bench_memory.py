"""Per-rank peak memory of training steps when the model is built on the meta device, and what
activation checkpointing and torch.compile change.

    python experiments/bench_memory.py --quick                 # small model, about 3 min on 2 cores
    python experiments/bench_memory.py --out experiments/results/bench_memory-2026-12-01-cpu2

Four parts, every measurement in its own processes (parts 1-3 spawned by ``moe.parallel.launch.run_local``,
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
   torch data path is one opaque operator (``torch.ops.causal_moe_kernels.sorted_moe_ffn``: the eager sorted
   path with output shapes known from its inputs), so the expert FLOPs are the eager ones.

4. **The trainer's own figures** (``--part trainer``): ``experiments/train.py`` on 1 and 4
   processes (``torchrun``, FSDP2) with its CPU malloc setting (``--cpu-mmap-threshold-kib``
   1024, the default) against glibc's defaults (``0``), the runs interleaved so both see the same
   load: the largest ``peak_memory_mib`` of the metrics JSONL (what a user reads) and the median
   step time after the first step, as ratios of the one setting to the other and of each world
   size to one process. $MALLOC_MMAP_THRESHOLD_ is removed from these runs' environment.

    python experiments/bench_memory.py --skip memory ac compile --trainer --ranks 1 4 --steps 6 --out experiments/results/bench_memory-trainer-2026-12-01-cpu2

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
import subprocess
import sys
import tempfile
import warnings
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.timing import Clocks  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402
from moe.parallel import rank_state_bytes  # noqa: E402
from moe.parallel.compile import compile_blocks  # noqa: E402
from moe.parallel.launch import ok_values, run_local  # noqa: E402
from moe.parallel.materialize import materialize, parameters_on_meta  # noqa: E402
from moe.parallel.memory import current_bytes, peak_bytes, reset_peak  # noqa: E402
from moe.parallel.mesh import Layout, ParallelMesh, fsdp_units, mixed_precision, shard_model  # noqa: E402
from moe.parallel.recompute import apply_activation_checkpointing  # noqa: E402

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
    apply_activation_checkpointing(model.blocks, ac)  # after compiling: see moe.parallel.recompute
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
        clocks = Clocks()
        out = model(idx[:, :-1], idx[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        if last:
            state = rank_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        times.append(clocks.lap()[0])
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


def train_cli(world: int, threshold_kib: int, model_kw: dict, args, metrics: Path) -> list[str]:
    """The command line of one trainer run (``torchrun`` on more than one process)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in model_kw.items()]
    script = "experiments/train.py"  # run from the repository root
    launch = ["python", script] if world == 1 else ["torchrun", "--standalone", f"--nproc-per-node={world}", script]
    return [
        *launch,
        "--preset=small",
        *flags,
        f"--steps={args.steps}",
        f"--batch-size={args.batch}",
        f"--seq-len={args.seq}",
        "--eval-windows=2",
        "--no-progress",
        "--wandb-mode=disabled",
        f"--cpu-mmap-threshold-kib={threshold_kib}",
        f"--metrics-jsonl={metrics}",
    ]


def trainer_run(world: int, threshold_kib: int, model_kw: dict, args) -> dict:
    """One ``experiments/train.py`` run: its largest peak_memory_mib and median step time."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    root = str(Path(__file__).resolve().parents[1])  # this checkout's moe, whatever is installed
    env.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join([root, str(Path(root) / "kernels"), env.get("PYTHONPATH", "")]),
    )
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        subprocess.run(train_cli(world, threshold_kib, model_kw, args, metrics), env=env, check=True, cwd=root)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_s = [args.batch * args.seq / r["tokens_per_s"] for r in records]
    return {
        "peak_mib": max(r["peak_memory_mib"] for r in records),
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[1:] or step_s),
    }


def trainer_part(args, model_kw: dict) -> dict:
    runs = {}
    for world in args.ranks:
        for kib in (0, 1024):  # glibc's defaults first, then the trainer's setting, same load
            r = runs[f"w{world}_kib{kib}"] = trainer_run(world, kib, model_kw, args)
            print(
                f"  {world} process(es), mmap threshold {kib or 'glibc default'}: peak {r['peak_mib']:,.0f} MiB, "
                f"step {r['median_step_s']:.2f} s",
                flush=True,
            )
    one = min(args.ranks)
    out = {"runs": runs, "command": " ".join(train_cli(max(args.ranks), 1024, model_kw, args, Path("metrics.jsonl")))}
    for world in args.ranks:
        base, fixed = runs[f"w{world}_kib0"], runs[f"w{world}_kib1024"]
        out[f"w{world}"] = {
            "peak_1mib_over_default": fixed["peak_mib"] / base["peak_mib"],
            "step_1mib_over_default": fixed["median_step_s"] / base["median_step_s"],
            "peak_over_one_process_default": base["peak_mib"] / runs[f"w{one}_kib0"]["peak_mib"],
            "peak_over_one_process_1mib": fixed["peak_mib"] / runs[f"w{one}_kib1024"]["peak_mib"],
        }
    return out


def trainer_markdown(res: dict) -> list[str]:
    t = res["trainer"]
    lines = [
        f"The trainer (`{t['command']}`, and the same with `--cpu-mmap-threshold-kib=0`): largest "
        "peak_memory_mib, median step time after the first",
        "",
        "| processes | peak MiB, glibc default | peak MiB, 1 MiB | 1 MiB / default | step s, default | step s, 1 MiB | "
        "1 MiB / default | peak / one process, default | peak / one process, 1 MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world in res["args"]["ranks"]:
        base, fixed, r = t["runs"][f"w{world}_kib0"], t["runs"][f"w{world}_kib1024"], t[f"w{world}"]
        lines.append(
            f"| {world} | {base['peak_mib']:,.0f} | {fixed['peak_mib']:,.0f} | {r['peak_1mib_over_default']:.3f} | "
            f"{base['median_step_s']:.2f} | {fixed['median_step_s']:.2f} | {r['step_1mib_over_default']:.2f} | "
            f"{r['peak_over_one_process_default']:.3f} | {r['peak_over_one_process_1mib']:.3f} |"
        )
    return [*lines, ""]


def memory_markdown(mem: dict) -> list[str]:
    lines = [
        "| run | rank | peak MiB | before model MiB | params MiB | grads MiB | optimizer MiB | peak / single |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, ranks in mem["runs"].items():
        for rank, r in enumerate(ranks):
            s = r["state"]
            lines.append(
                f"| {name} | {rank} | {r['peak'] / MIB:,.0f} | {r['before_model'] / MIB:,.0f} | "
                f"{s['params'] / MIB:,.0f} | {s['grads'] / MIB:,.0f} | {s['optimizer'] / MIB:,.0f} | "
                f"{r['peak'] / mem['single_peak']:.3f} |"
            )
    return [
        *lines,
        "",
        "Largest per-rank peak over the single-process peak: "
        + ", ".join(f"{k} {v:.3f}" for k, v in mem["peak_ratio_to_single"].items()),
        "",
    ]


def markdown(res: dict) -> str:
    lines = [
        f"# bench_memory ({res['date']}, {res['device']})",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Model: {res['model']} ({res['num_parameters']:,} parameters); memory steps on a global batch of "
        f"{res['args']['batch']} x {res['args']['seq']} tokens; malloc of parts 1-3: "
        + ("glibc default" if res["args"].get("glibc_default") else "MALLOC_MMAP_THRESHOLD_=65536")
        + ".",
        "",
    ]
    if res.get("memory"):
        lines += memory_markdown(res["memory"])
    if res.get("trainer"):
        lines += trainer_markdown(res)
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
    p.add_argument(
        "--trainer",
        action="store_true",
        help="part 4: experiments/train.py with its 1 MiB mmap threshold against glibc's defaults (--ranks, --steps)",
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
    if args.trainer:
        print("the trainer's peak_memory_mib and step time:", flush=True)
        res["trainer"] = trainer_part(args, model_kw)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
        if "memory" in res or "trainer" in res:
            Path(f"{args.out}.md").write_text(markdown(res))
    if "memory" in res:
        print(json.dumps(res["memory"]["peak_ratio_to_single"]))


if __name__ == "__main__":
    main()
