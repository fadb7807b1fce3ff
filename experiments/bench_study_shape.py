"""Training speed at the router study's shape (issue 29, item 7): nanoGPT's CPU "baby" model,
dense against MoE of equal active FLOPs, eager and compiled, and where the MoE step's extra time
goes. Every figure is a ratio to the dense baseline measured in the same run.

    PYTHONPATH=.:kernels nice python experiments/bench_study_shape.py                # 3-10 min on the shared 2 cores
    PYTHONPATH=.:kernels nice python experiments/bench_study_shape.py --no-compile   # eager only, about half of that
    PYTHONPATH=.:kernels nice python experiments/bench_study_shape.py --quick        # smoke run, about 1 min

The shape: 4 blocks, d_model 128, 4 heads, T=64, batch 12 (768 tokens a step), byte vocabulary
(the embedded stdlib corpus: the data do not change the arithmetic), AdamW as the study runs it
(lr 1e-3, beta2 0.99, clipping 1.0). MoE blocks: 8 experts of width 256, ``topk`` with top-2 or
``ec_threshold`` with capacity factor 2; the dense model a SwiGLU of width 512, the same
multiply-adds per token.

Three measurements, one torch thread, interleaved (each round runs every configuration's burst
of steps or every phase once, in an order shuffled per round; medians over rounds):

1. ``steps``: ``moe.training.loop.train_step``, the step ``train()`` runs (batch, forward,
   backward, clipping, AdamW, router updates, the step's metrics), on sessions built by
   ``moe.training.loop.prepare``; tokens/s from wall time and from process CPU time. The
   machine is shared, so CPU time (what this process got) is the steadier figure; wall time is
   what a run sees.
2. ``step_phases``: the same step cut into its parts (forward, backward, StepTally, clip +
   AdamW, router updates, metrics), and the optimizer step alone as the loop's ``BlockedAdamW``,
   torch's for-loop AdamW (its CPU default), ``foreach`` and ``fused`` AdamW, on copies of the
   model's gradients.
3. ``layer_phases``: one MoE layer's forward+backward at N=768 by phase, each phase its own
   forward+backward on the inputs the layer would give it: the router (gate, top-k, weights,
   aux losses, statistics) and, of it, the aux losses and the statistics; the RouterEntropy hook;
   the sort (layout, host reads); the gather; the per-expert SwiGLU; the combine; against a
   dense SwiGLU of width 512 on the same tokens.

Writes ``experiments/results/bench_study_shape-<date>-cpu1[-<label>].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from causal_moe_kernels.reference import combine_rows, gather_rows, grouped_swiglu, sort_by_expert, token_slots
from moe.layer import MoELayer, update_routers
from moe.model import SwiGLU
from moe.training.batches import local_batch
from moe.training.config import TrainConfig
from moe.training.distributed import setup_distributed
from moe.training.loop import Session, prepare, train_step
from moe.training.metrics import RouterEntropy, StepTally
from moe.training.optim import BlockedAdamW, lr_at, set_lr

SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 64}
SEQ_LEN, BATCH = 64, 12
TOKENS = SEQ_LEN * BATCH
MOE = {"num_experts": 8, "moe_d_ff": 256}
ROUTERS = {
    "dense": ("topk", {}),
    "topk": ("topk", {"top_k": 2}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 2.0}),
}
"""name -> (router, options); "dense" has no MoE block (moe_every 0, d_ff 512)."""


def run_config(name: str, compiled: bool) -> TrainConfig:
    router, options = ROUTERS[name]
    model = {**SHAPE, "moe_every": 0, "d_ff": 512} if name == "dense" else {**SHAPE, **MOE}
    return TrainConfig.flat(
        router=router,
        router_options=options,
        model=model,
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        max_bytes=1_000_000,
        steps=100_000,
        lr=1e-3,
        beta2=0.99,
        warmup_steps=100,
        device="cpu",
        compile=compiled,
        log_every=0,
        progress=False,
        wandb_mode="disabled",
    )


class Clocks:
    """Wall and process CPU time since the last call."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def medians(samples: list[tuple[float, float]]) -> dict:
    return {
        "wall_s": statistics.median(w for w, _ in samples),
        "cpu_s": statistics.median(c for _, c in samples),
        "n": len(samples),
    }


def bench_steps(sessions: dict[str, Session], rounds: int, burst: int, warmup: int) -> dict:
    """Median seconds per ``train_step`` of each session, interleaved in bursts."""
    step = dict.fromkeys(sessions, 0)
    samples: dict[str, list] = {k: [] for k in sessions}
    names = list(sessions)
    for r in range(warmup + rounds):
        random.shuffle(names)
        for name in names:
            for _ in range(burst):
                step[name] += 1
                clocks = Clocks()
                train_step(sessions[name], step[name])
                if r >= warmup:
                    samples[name].append(clocks.lap())
    return {k: medians(v) for k, v in samples.items()}


def phased_step(s: Session, step: int) -> dict[str, tuple[float, float]]:
    """``train_step``'s work for one process, in its order, timed part by part."""
    cfg, place, device = s.cfg, s.place, s.info.device
    clocks, laps = Clocks(), {}
    set_lr(s.optimizer, lr_at(step - 1, cfg.optimizer))
    idx_BT, targets_BT = local_batch(s.corpus, cfg.data, cfg.seed, step, device)
    s.entropy.pop()
    s.optimizer.zero_grad(set_to_none=True)
    tally = StepTally(place.num_moe_layers(), s.num_experts, device)
    laps["batch, zero_grad"] = clocks.lap()
    out = place.model(idx_BT, targets_BT)
    laps["forward (incl. entropy hooks)"] = clocks.lap()
    (out.loss + out.aux_loss).backward()
    laps["backward"] = clocks.lap()
    tally.add_output(out)
    laps["StepTally.add_output"] = clocks.lap()
    s.strategy.update(step)
    laps["clip + AdamW"] = clocks.lap()
    update_routers(place.model)
    laps["update_routers"] = clocks.lap()
    tally.finish(s.entropy.pop())
    laps["StepTally.finish (host reads)"] = clocks.lap()
    return laps


def optimizer_variants(s: Session) -> dict[str, Callable[[], None]]:
    """AdamW steps on copies of the session's parameters and gradients: the loop's own
    (``BlockedAdamW``), torch's for-loop implementation (its CPU default), foreach and fused."""
    groups = []
    for group in s.optimizer.param_groups:
        params = []
        for p in group["params"]:
            q = p.detach().clone().requires_grad_(True)
            q.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            params.append(q)
        groups.append({"params": params, "weight_decay": group["weight_decay"]})
    kw = {"lr": 1e-3, "betas": (0.9, 0.99)}
    variants = {
        "BlockedAdamW (the loop's)": BlockedAdamW(groups, **kw),
        "AdamW for-loop (torch's CPU default)": torch.optim.AdamW(groups, foreach=False, **kw),
        "AdamW foreach": torch.optim.AdamW(groups, foreach=True, **kw),
        "AdamW fused": torch.optim.AdamW(groups, fused=True, **kw),
    }
    return {name: opt.step for name, opt in variants.items()}


def bench_step_phases(sessions: dict[str, Session], rounds: int) -> dict:
    step = dict.fromkeys(sessions, 10_000)
    samples: dict[str, dict[str, list]] = {k: {} for k in sessions}
    names = list(sessions)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            step[name] += 1
            for phase, lap in phased_step(sessions[name], step[name]).items():
                samples[name].setdefault(phase, []).append(lap)
    opts = {name: optimizer_variants(s) for name, s in sessions.items()}
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            for variant, fn in opts[name].items():
                clocks = Clocks()
                fn()
                samples[name].setdefault(variant, []).append(clocks.lap())
    return {k: {phase: medians(v) for phase, v in per.items()} for k, per in samples.items()}


def layer_phase_fns(layer: MoELayer, dense: SwiGLU, x_BTD: torch.Tensor) -> dict[str, Callable[[], None]]:
    """name -> one forward+backward of that phase on what the layer would give it (fresh leaves)."""
    router, ex = layer.router, layer.experts
    b, t, d = x_BTD.shape
    n = b * t
    with torch.no_grad():
        routing = router(x_BTD)
        logits_NE = router.gate(x_BTD.reshape(n, d))
    token_A, expert_A, weight_A = routing.token, routing.expert, routing.weight
    order_A, counts_E = sort_by_expert(expert_A, layer.num_experts)
    token_sorted_A = token_A[order_A]
    slot_A, num_slots = token_slots(token_sorted_A, n)
    counts = counts_E.tolist()
    x_ND = x_BTD.reshape(n, d)
    x_AD = x_ND[token_sorted_A]
    entropy = RouterEntropy(torch.nn.Module())  # its hook alone, called by hand

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(True)

    def backward(y: torch.Tensor) -> None:
        y.backward(torch.ones_like(y))

    def aux_losses() -> None:
        logits = leaf(logits_NE)
        router._aux_loss(logits, torch.softmax(logits, -1), expert_A).backward()

    return {
        "dense SwiGLU 512 (baseline)": lambda: backward(dense(leaf(x_BTD))),
        "MoE layer (whole)": lambda: _layer_fwd_bwd(layer, leaf(x_BTD)),
        "router (gate, top-k, weights, aux, stats)": lambda: _router_fwd_bwd(router, leaf(x_BTD)),
        "  of which aux + z losses": aux_losses,
        "  of which statistics": lambda: router._stats(expert_A, expert_A.numel()),
        "RouterEntropy hook (metrics)": lambda: entropy._hook(router.gate, (), logits_NE),
        "sort + slots (layout, host reads)": lambda: (
            sort_by_expert(expert_A, layer.num_experts)[1].tolist(),
            token_slots(token_A[order_A], n),
        ),
        "gather (dispatch)": lambda: backward(gather_rows(leaf(x_ND), token_sorted_A, slot_A, num_slots)),
        "experts (per-expert SwiGLU)": lambda: backward(
            grouped_swiglu(leaf(x_AD), counts, ex.w_gate, ex.w_up, ex.w_down)
        ),
        "combine (weights, slot sum)": lambda: backward(
            combine_rows(leaf(x_AD), leaf(weight_A)[order_A], token_sorted_A, slot_A, num_slots, n)
        ),
    }


def _layer_fwd_bwd(layer: MoELayer, x_BTD: torch.Tensor) -> None:
    y, routing = layer(x_BTD, return_routing=True)
    (y.sum() + routing.aux_loss).backward()


def _router_fwd_bwd(router, x_BTD: torch.Tensor) -> None:
    routing = router(x_BTD)
    (routing.weight.sum() + routing.aux_loss).backward()


def bench_layer_phases(rounds: int) -> dict:
    torch.manual_seed(0)
    layer = MoELayer(SHAPE["d_model"], MOE["moe_d_ff"], MOE["num_experts"], router="topk", top_k=2)
    dense = SwiGLU(SHAPE["d_model"], 512)
    fns = layer_phase_fns(layer, dense, torch.randn(BATCH, SEQ_LEN, SHAPE["d_model"]))
    samples: dict[str, list] = {k: [] for k in fns}
    names = list(fns)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            for p in (*layer.parameters(), *dense.parameters()):
                p.grad = None
            clocks = Clocks()
            fns[name]()
            samples[name].append(clocks.lap())
    return {k: medians(v) for k, v in samples.items()}


def add_step_ratios(steps: dict) -> dict:
    """tokens/s, and each run's tokens/s over its dense baseline's (eager against eager dense,
    compiled against compiled dense) and over eager dense's."""
    for name, v in steps.items():
        base = steps["dense compiled" if name.endswith(" compiled") else "dense"]
        for c in ("wall", "cpu"):
            v[f"tokens_per_s_{c}"] = TOKENS / v[f"{c}_s"]
            v[f"{c}_tokens_per_s_vs_dense"] = base[f"{c}_s"] / v[f"{c}_s"]
        v["cpu_tokens_per_s_vs_eager_dense"] = steps["dense"]["cpu_s"] / v["cpu_s"]
    return steps


def with_ratios(rows: dict, base: dict, key: str) -> dict:
    """Each row with ``<key>_vs_dense`` (row time / baseline time; below 1 is faster)."""
    return {k: {**v, f"{key}_vs_dense": v[key] / base[key]} for k, v in rows.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the step benchmark")
    p.add_argument("--burst", type=int, default=3, help="consecutive steps of one configuration per round")
    p.add_argument("--phase-rounds", type=int, default=40, help="rounds of the step and layer breakdowns")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled sessions")
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds, eager only")
    p.add_argument("--label", default="", help="appended to the results' file names")
    p.add_argument("--out-dir", default="experiments/results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.rounds, args.phase_rounds, args.no_compile = 3, 5, True
    info = setup_distributed("cpu")
    modes = [False] if args.no_compile else [False, True]
    sessions = {
        f"{name}{' compiled' if c else ''}": prepare(run_config(name, c), None, info) for c in modes for name in ROUTERS
    }
    for s in sessions.values():
        s.place.model.train()
    t0 = time.time()
    steps = add_step_ratios(bench_steps(sessions, args.rounds, args.burst, warmup=1 if args.quick else 2))
    eager = {k: s for k, s in sessions.items() if "compiled" not in k}
    phases = bench_step_phases(eager, args.phase_rounds)
    layer = bench_layer_phases(args.phase_rounds)
    result = {
        "date": dt.date.today().isoformat(),
        "command": " ".join(
            ["PYTHONPATH=.:kernels nice python experiments/bench_study_shape.py", *(argv or sys.argv[1:])]
        ),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "shape": {**SHAPE, **MOE, "seq_len": SEQ_LEN, "batch_size": BATCH, "dense_d_ff": 512},
        "routers": {k: {"router": r, "options": o} for k, (r, o) in ROUTERS.items()},
        "rounds": args.rounds,
        "burst": args.burst,
        "phase_rounds": args.phase_rounds,
        "steps": steps,
        "step_phases": phases,
        "layer_phases": with_ratios(layer, layer["dense SwiGLU 512 (baseline)"], "cpu_s"),
        "seconds": time.time() - t0,
    }
    write(result, Path(args.out_dir), args.label)
    return result


def markdown(r: dict) -> str:
    lines = [
        f"# bench_study_shape {r['date']} (torch {r['torch']}, {r['threads']} thread, load {r['load_average'][0]:.1f})",
        "",
        f"`{r['command']}`; medians of {r['rounds']} interleaved rounds x {r['burst']} steps.",
        "",
        "| run | tokens/s (wall) | tokens/s (CPU) | vs dense, wall | vs dense, CPU | vs eager dense, CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, v in r["steps"].items():
        lines.append(
            f"| {k} | {v['tokens_per_s_wall']:,.0f} | {v['tokens_per_s_cpu']:,.0f} | {v['wall_tokens_per_s_vs_dense']:.3f} "
            f"| {v['cpu_tokens_per_s_vs_dense']:.3f} | {v['cpu_tokens_per_s_vs_eager_dense']:.3f} |"
        )
    names = list(r["step_phases"])
    lines += ["", "Step phases, CPU ms (medians of " + str(r["phase_rounds"]) + "):", ""]
    lines += ["| phase | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for phase in r["step_phases"]["dense"]:
        cells = [f"{r['step_phases'][n][phase]['cpu_s'] * 1e3:.2f}" for n in names]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines += ["", "One MoE layer (topk, N=768) forward+backward by phase, CPU ms and x dense SwiGLU 512:", ""]
    lines += ["| phase | ms | x dense |", "|---|---:|---:|"]
    for phase, v in r["layer_phases"].items():
        lines.append(f"| {phase} | {v['cpu_s'] * 1e3:.3f} | {v['cpu_s_vs_dense']:.3f} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path, label: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_study_shape-{result['date']}-cpu{result['threads']}{'-' + label if label else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
