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

Three measurements, one torch thread, through ``experiments/timing.py`` (interleaved: each round
runs every configuration's burst of steps or every phase once, in an order shuffled per round;
medians over rounds):

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
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from causal_moe_kernels.reference import (  # noqa: E402
    combine_rows,
    gather_rows,
    grouped_swiglu,
    sort_by_expert,
    token_slots,
)
from experiments.timing import Clocks, Phases, Samples, interleaved, interleaved_phases  # noqa: E402
from moe.layer import MoELayer, update_routers  # noqa: E402
from moe.model import SwiGLU  # noqa: E402
from moe.training.batches import local_batch  # noqa: E402
from moe.training.config import TrainConfig  # noqa: E402
from moe.training.distributed import setup_distributed  # noqa: E402
from moe.training.loop import Session, prepare, train_step  # noqa: E402
from moe.training.metrics import RouterEntropy, StepTally  # noqa: E402
from moe.training.optim import BlockedAdamW, lr_at, set_lr  # noqa: E402

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


def stepping(sessions: dict[str, Session], fn: Callable, first: int = 1) -> dict[str, Callable]:
    """name -> ``fn(session, step, *args)`` at that session's next step (each session counts its
    own steps from ``first``), ``args`` what the timing harness passes (``Phases``, or nothing)."""

    def bind(s: Session, steps: itertools.count) -> Callable:
        return lambda *args: fn(s, next(steps), *args)

    return {name: bind(s, itertools.count(first)) for name, s in sessions.items()}


def medians(samples: dict) -> dict:
    """The timing harness's samples, nested in dicts, as ``{"wall_s", "cpu_s", "n"}``."""
    return {k: v.medians() if isinstance(v, Samples) else medians(v) for k, v in samples.items()}


def phased_step(s: Session, step: int, phases: Phases) -> None:
    """``train_step``'s work for one process, in its order, ``phases.end`` after each part."""
    cfg, place, device = s.cfg, s.place, s.info.device
    set_lr(s.optimizer, lr_at(step - 1, cfg.optimizer))
    idx_BT, targets_BT = local_batch(s.corpus, cfg.data, cfg.seed, step, device)
    s.entropy.pop()
    s.optimizer.zero_grad(set_to_none=True)
    tally = StepTally(place.num_moe_layers(), s.num_experts, device)
    phases.end("batch, zero_grad")
    out = place.model(idx_BT, targets_BT)
    phases.end("forward (incl. entropy hooks)")
    (out.loss + out.aux_loss).backward()
    phases.end("backward")
    tally.add_output(out)
    phases.end("StepTally.add_output")
    s.strategy.update(step)
    phases.end("clip + AdamW")
    update_routers(place.model)
    phases.end("update_routers")
    tally.finish(s.entropy.pop())
    phases.end("StepTally.finish (host reads)")


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


def optimizer_samples(sessions: dict[str, Session], rounds: int, kept: tuple[str, ...] | None = None) -> dict:
    """name -> variant -> the samples of that AdamW step alone (``optimizer_variants``, those of
    ``kept`` or all), every session's variants interleaved with each other."""
    fns = {
        (name, variant): fn
        for name, s in sessions.items()
        for variant, fn in optimizer_variants(s).items()
        if kept is None or variant in kept
    }
    out: dict[str, dict] = {name: {} for name in sessions}
    for (name, variant), samples in interleaved(fns, rounds).items():
        out[name][variant] = samples
    return out


def bench_step_phases(sessions: dict[str, Session], rounds: int) -> dict:
    phases = interleaved_phases(stepping(sessions, phased_step, 10_001), rounds)
    for name, per in optimizer_samples(sessions, rounds).items():
        phases[name].update(per)
    return medians(phases)


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
    params = [*layer.parameters(), *dense.parameters()]

    def fresh(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:  # every phase's backward writes fresh gradients: none kept from the last call
            for p in params:
                p.grad = None
            fn()

        return run

    return medians(interleaved({name: fresh(fn) for name, fn in fns.items()}, rounds))


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


def arguments(doc: str, quick: str, rounds: tuple[int, str], burst: int) -> argparse.ArgumentParser:
    """The options of a CPU step benchmark (this one and ``bench_step_phases.py``): its docstring
    as the help, ``--quick`` (``quick`` says what it runs), ``--rounds`` (default and help),
    ``--burst`` (default), ``--label`` and ``--out-dir``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--rounds", type=int, default=rounds[0], help=rounds[1])
    p.add_argument("--burst", type=int, default=burst, help="consecutive steps of one configuration per round")
    p.add_argument("--label", default="", help="appended to the results' file names")
    p.add_argument("--out-dir", default="experiments/results")
    return p


def start(script: str, p: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The parsed options, one torch thread, and what a result starts with: the date, the
    command, torch's version and threads."""
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    head = {
        "date": dt.date.today().isoformat(),
        "command": " ".join([f"PYTHONPATH=.:kernels nice python experiments/{script}.py", *(argv or sys.argv[1:])]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return args, head


def main(argv: list[str] | None = None) -> dict:
    p = arguments(__doc__, "a smoke run: 3 rounds, eager only", (15, "interleaved rounds of the step benchmark"), 3)
    p.add_argument("--phase-rounds", type=int, default=40, help="rounds of the step and layer breakdowns")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled sessions")
    args, head = start("bench_study_shape", p, argv)
    if args.quick:
        args.rounds, args.phase_rounds, args.no_compile = 3, 5, True
    info = setup_distributed("cpu")
    modes = [False] if args.no_compile else [False, True]
    sessions = {
        f"{name}{' compiled' if c else ''}": prepare(run_config(name, c), None, info) for c in modes for name in ROUTERS
    }
    for s in sessions.values():
        s.place.model.train()
    clocks = Clocks()
    samples = interleaved(stepping(sessions, train_step), args.rounds, warmup=1 if args.quick else 2, burst=args.burst)
    steps = add_step_ratios(medians(samples))
    eager = {k: s for k, s in sessions.items() if "compiled" not in k}
    phases = bench_step_phases(eager, args.phase_rounds)
    layer = bench_layer_phases(args.phase_rounds)
    result = {
        **head,
        "shape": {**SHAPE, **MOE, "seq_len": SEQ_LEN, "batch_size": BATCH, "dense_d_ff": 512},
        "routers": {k: {"router": r, "options": o} for k, (r, o) in ROUTERS.items()},
        "rounds": args.rounds,
        "burst": args.burst,
        "phase_rounds": args.phase_rounds,
        "steps": steps,
        "step_phases": phases,
        "layer_phases": with_ratios(layer, layer["dense SwiGLU 512 (baseline)"], "cpu_s"),
    }
    return finish("bench_study_shape", result, args, markdown, clocks)


def markdown(r: dict) -> str:
    lines = [
        title("bench_study_shape", r),
        "",
        f"`{r['command']}`; medians of {r['rounds']} interleaved rounds x {r['burst']} steps.",
        "",
        *steps_table(r["steps"], "tokens_per_s_vs"),
    ]
    lines += ["", "Step phases, CPU ms (medians of " + str(r["phase_rounds"]) + "):", ""]
    lines += phases_table(r["step_phases"])
    lines += ["", "One MoE layer (topk, N=768) forward+backward by phase, CPU ms and x dense SwiGLU 512:", ""]
    lines += ["| phase | ms | x dense |", "|---|---:|---:|"]
    for phase, v in r["layer_phases"].items():
        lines.append(f"| {phase} | {v['cpu_s'] * 1e3:.3f} | {v['cpu_s_vs_dense']:.3f} |")
    return "\n".join(lines) + "\n"


def steps_table(steps: dict, ratio: str) -> list[str]:
    """Markdown rows of whole steps: tokens/s and the ratios ``<clock>_<ratio>_dense`` and
    ``cpu_<ratio>_eager_dense`` (``add_step_ratios``'s ``tokens_per_s_vs``, or ``vs``)."""
    lines = [
        "| run | tokens/s (wall) | tokens/s (CPU) | vs dense, wall | vs dense, CPU | vs eager dense, CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, v in steps.items():
        lines.append(
            f"| {k} | {v['tokens_per_s_wall']:,.0f} | {v['tokens_per_s_cpu']:,.0f} | {v[f'wall_{ratio}_dense']:.3f} "
            f"| {v[f'cpu_{ratio}_dense']:.3f} | {v[f'cpu_{ratio}_eager_dense']:.3f} |"
        )
    return lines


def phases_table(phases: dict) -> list[str]:
    """Markdown rows of CPU ms: a row per phase (those of the first run), a column per run."""
    names = list(phases)
    lines = ["| phase | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for phase in phases[names[0]]:
        lines.append(f"| {phase} | " + " | ".join(f"{phases[n][phase]['cpu_s'] * 1e3:.2f}" for n in names) + " |")
    return lines


def title(script: str, r: dict) -> str:
    """A result table's first line: the script, the date, torch, threads and load."""
    return f"# {script} {r['date']} (torch {r['torch']}, {r['threads']} thread, load {r['load_average'][0]:.1f})"


def finish(
    script: str, result: dict, args: argparse.Namespace, markdown: Callable[[dict], str], clocks: Clocks
) -> dict:
    """``result`` with the load average and the seconds since ``clocks`` began, written to
    ``<out-dir>/<script>-<date>-cpu<threads>[-<label>].{json,md}``; the table printed."""
    result.update(load_average=os.getloadavg(), seconds=clocks.lap()[0])
    table = markdown(result)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{script}-{result['date']}-cpu{result['threads']}{'-' + args.label if args.label else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
