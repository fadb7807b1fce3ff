"""Where the router study's training step spends its time (issue 57): the study's own rows
(``router_study.row_config``: Shakespeare BPE, seed 6) at its baby and large sizes, the dense
twin against the MoE routers, one torch thread. Every figure is a ratio to the dense row
measured in the same run.

    PYTHONPATH=.:kernels nice python experiments/bench_step_phases.py --sizes baby large
    PYTHONPATH=.:kernels nice python experiments/bench_step_phases.py --sizes baby --compile   # adds compiled sessions
    PYTHONPATH=.:kernels nice python experiments/bench_step_phases.py --quick                  # smoke run, about 1 min

Measurements through ``experiments/timing.py``, interleaved (each round runs every session
once, in an order shuffled per round; medians over rounds), wall and process CPU time (the
machine is shared: CPU time is what this process got, the steadier figure):

1. ``steps``: ``moe.training.loop.train_step``, the whole step ``train()`` runs, in bursts;
   tokens/s and the ratio to the dense row of the same mode (eager or compiled).
2. ``phases``: the same step's work cut into data (lr, batch, zero_grad),
   forward, backward, statistics (``StepTally.add_output``), clipping, the AdamW step, router
   updates (``update_routers``), logging (``StepTally.finish``: the host reads of the step's
   metrics).
3. ``optimizer``: the AdamW step alone on copies of each eager row's parameters and gradients,
   ``BlockedAdamW`` against torch's for-loop AdamW and its fused one (``--optimizer-rounds``).
4. ``operators`` (``--profile-steps N``): ``torch.profiler`` over N more whole steps of each
   eager row, after the timing: every operator's own CPU time and calls per step, and for each
   MoE row the operators whose time grew most over the dense twin's (the profiler's own
   overhead per call inflates both sides; read the differences, not the totals).

``--torch-adamw`` adds each row with torch's own AdamW (the loop's optimizer before issue 57)
beside the loop's ``BlockedAdamW``: the optimizer's effect as a ratio in the same run.
``--frozen-routing`` adds each MoE row with its routers frozen (:func:`freeze_routing`): the
assignments of one earlier forward, no gate gradient, no aux loss; what the step would cost if
routing cost nothing (its numbers are not the row's). ``--malloc-threshold`` runs every session
at the trainer's default 1 MiB mmap threshold instead of the study's kept memory
(``cpu_malloc_keep``), which moves the ratios (docs/benchmarks.md). ``--shrunk`` adds every row
with its widths and batch shrunk (:data:`SHRUNK`: the same layers, routers, vocabulary and code
paths, arithmetic made negligible): its step is the fixed cost of the step's operators
(Python, dispatch, autograd, allocation), and the MoE rows' gap over the shrunk dense row is the
part of the full-size gap that fewer operators could remove.

Writes ``experiments/results/bench_step_phases-<date>-cpu1[-<label>].{json,md}``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_study  # noqa: E402  (the study's sizes, recipe, corpus and row config)
from bench_study_shape import (  # noqa: E402
    arguments,
    finish,
    medians,
    optimizer_samples,
    phases_table,
    start,
    stepping,
    steps_table,
    title,
)

from experiments.timing import Clocks, Phases, interleaved, interleaved_phases  # noqa: E402
from moe.global_balance import global_batch_loads  # noqa: E402
from moe.layer import update_routers  # noqa: E402
from moe.parallel.state import clip_grad_norm_  # noqa: E402
from moe.routers.quantile_global import register_quantile_balancing_hook  # noqa: E402
from moe.routing import Router, Routing  # noqa: E402
from moe.training.batches import local_batch  # noqa: E402
from moe.training.config import TrainConfig  # noqa: E402
from moe.training.distributed import setup_distributed  # noqa: E402
from moe.training.loop import Session, prepare, train_step  # noqa: E402
from moe.training.metrics import StepTally  # noqa: E402
from moe.training.optim import lr_at, set_lr  # noqa: E402

CORPUS, SEED = "shakespeare-bpe", 6
LABELS = ["dense", "topk_aux", "expert_threshold", "quantile"]
SHRUNK = {"model": {"d_model": 16, "moe_d_ff": 16, "d_ff": 32, "max_seq_len": 8}, "seq_len": 8, "batch_size": 2}
"""``--shrunk``: a row's model and batch with arithmetic made negligible (D 16, experts of width 16
and the dense twin of 32, T 8, batch 2), every other field the row's."""


def session(
    size: str,
    label: str,
    compiled: bool,
    info,
    torch_adamw: bool = False,
    malloc_kept: bool = True,
    shrunk: bool = False,
) -> Session:
    """A session of the study's row; ``torch_adamw``: with torch's own AdamW (the loop's before
    issue 57) instead of the loop's ``BlockedAdamW``, the same groups and settings;
    ``malloc_kept=False``: the trainer's default 1 MiB mmap threshold instead of the study's
    kept memory (a process-wide setting: every session of a run the same); ``shrunk``: the
    row's model and batch shrunk to :data:`SHRUNK`."""
    fields = router_study.row_config(CORPUS, size, label, SEED, quick=False)
    fields = {**fields, "steps": 100_000, "compile": compiled, "cpu_malloc_keep": malloc_kept}
    if shrunk:
        model = {k: v for k, v in SHRUNK["model"].items() if k in fields["model"]}
        fields = {**fields, **SHRUNK, "model": {**fields["model"], **model}}
    s = prepare(TrainConfig.flat(**fields), None, info)
    s.place.model.train()
    if torch_adamw:
        use_torch_adamw(s)
    return s


def use_torch_adamw(s: Session) -> None:
    """Give a fresh session torch's own AdamW over the same groups and settings."""
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in s.optimizer.param_groups]
    o = s.cfg.optimizer
    s.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))
    s.strategy.attach(s.optimizer)
    register_quantile_balancing_hook(s.optimizer, s.place.model)


def tokens_per_step(s: Session) -> int:
    return s.cfg.data.batch_size * s.cfg.data.seq_len


def phased_step(s: Session, step: int, phases: Phases) -> None:
    """``train_step``'s work on one process (the plain strategy, one microbatch), in its order,
    ``phases.end`` after each part."""
    cfg, place, device = s.cfg, s.place, s.info.device
    set_lr(s.optimizer, lr_at(step - 1, cfg.optimizer))
    idx_BT, targets_BT = local_batch(s.corpus, cfg.data, cfg.seed, step, device)
    s.entropy.pop()
    s.optimizer.zero_grad(set_to_none=True)
    tally = StepTally(place.num_moe_layers(), s.num_experts, device)
    phases.end("data (lr, batch, zero_grad)")
    with global_batch_loads(place.model, [None]):
        out = s.strategy._forward(idx_BT, targets_BT)
        phases.end("forward")
        (out.loss + out.aux_loss).backward()
        phases.end("backward")
    tally.add_output(out)
    phases.end("router statistics (StepTally)")
    clip_grad_norm_(place.model, cfg.optimizer.grad_clip)
    phases.end("clip")
    s.optimizer.step()
    phases.end("AdamW")
    update_routers(place.model)
    phases.end("router updates (balance)")
    tally.finish(s.entropy.pop())
    phases.end("logging (StepTally.finish)")


def freeze_routing(s: Session, step: int) -> None:
    """Make every router of ``s`` return, from now on, the routing that its forward in training
    step ``step`` gives (run here), detached: the same assignments and statistics, weights
    without a gradient, no aux loss. The step then costs what it would if routing cost nothing
    (the experts, the sorted layout and the optimizer as before): an accounting device for
    ``--frozen-routing``, whose numbers are not the row's."""
    routers = [m for m in s.place.model.modules() if isinstance(m, Router)]
    frozen: dict[Router, Routing] = {}

    def keep(router: Router, inputs, routing: Routing) -> None:
        frozen[router] = replace(
            routing,
            weight=routing.weight.detach(),
            aux_loss=torch.zeros_like(routing.aux_loss.detach()),
            stats={k: v.detach() for k, v in routing.stats.items()},
        )

    handles = [r.register_forward_hook(keep) for r in routers]
    train_step(s, step)
    for h in handles:
        h.remove()
    for r in routers:
        r.forward = lambda *args, _routing=frozen[r], **kwargs: _routing


def add_ratios(steps: dict, tokens: dict[str, int]) -> dict:
    """tokens/s (``tokens``: each run's tokens a step), and each run's tokens/s over the dense
    row of the same variant (``"topk_aux torch-AdamW compiled"`` over ``"dense torch-AdamW
    compiled"``, ``"topk_aux shrunk"`` over ``"dense shrunk"``; the eager dense row where the
    variant has no dense row of its own, as ``frozen-routing``) and over eager dense's of the
    same widths."""
    for name, v in steps.items():
        base = steps.get("dense" + name.removeprefix(name.split(" ")[0]), steps["dense"])
        eager = steps["dense shrunk" if name.endswith(" shrunk") else "dense"]
        for c in ("wall", "cpu"):
            v[f"tokens_per_s_{c}"] = tokens[name] / v[f"{c}_s"]
            v[f"{c}_vs_dense"] = base[f"{c}_s"] / v[f"{c}_s"]
        v["cpu_vs_eager_dense"] = eager["cpu_s"] / v["cpu_s"]
    return steps


def bench(
    size: str,
    labels: list[str],
    compiled: bool,
    torch_adamw: bool,
    rounds: int,
    burst: int,
    optimizer_rounds: int,
    profile_steps: int,
    malloc_kept: bool,
    frozen_routing: bool,
    shrunk: bool,
    info,
) -> dict:
    modes = [False, True] if compiled else [False]
    sessions = {
        f"{label}{' compiled' if c else ''}": session(size, label, c, info, malloc_kept=malloc_kept)
        for c in modes
        for label in labels
    }
    if frozen_routing:
        for label in labels[1:]:
            sessions[f"{label} frozen-routing"] = session(size, label, False, info, malloc_kept=malloc_kept)
            freeze_routing(sessions[f"{label} frozen-routing"], 9_999)
    if torch_adamw:
        sessions.update(
            {
                f"{label} torch-AdamW{' compiled' if c else ''}": session(size, label, c, info, True, malloc_kept)
                for c in modes
                for label in labels
            }
        )
    if shrunk:
        sessions.update(
            {f"{label} shrunk": session(size, label, False, info, False, malloc_kept, True) for label in labels}
        )
    tokens = {name: tokens_per_step(s) for name, s in sessions.items()}
    steps = add_ratios(medians(interleaved(stepping(sessions, train_step), rounds, warmup=2, burst=burst)), tokens)
    phases = medians(interleaved_phases(stepping(sessions, phased_step), rounds, warmup=1))
    eager = {k: s for k, s in sessions.items() if k in labels}
    return {
        "tokens_per_step": tokens[labels[0]],
        "steps": steps,
        "phases": phases,
        "optimizer": bench_optimizer(eager, optimizer_rounds) if optimizer_rounds else {},
        "operators": operator_profile(eager, profile_steps) if profile_steps else {},
    }


def bench_optimizer(sessions: dict[str, Session], rounds: int) -> dict:
    """The AdamW step alone, the loop's ``BlockedAdamW`` against torch's for-loop AdamW and its
    fused one (one pass over memory, not bitwise the for-loop's), on copies of each session's
    parameters and last gradients, interleaved; medians. ``speedup_cpu``: the for-loop's time
    over ``BlockedAdamW``'s; ``fused_speedup_cpu``: ``BlockedAdamW``'s over the fused one's."""
    kept = ("BlockedAdamW (the loop's)", "AdamW for-loop (torch's CPU default)", "AdamW fused")
    out = medians(optimizer_samples(sessions, rounds, kept))
    for name, per in out.items():
        per["speedup_cpu"] = per[kept[1]]["cpu_s"] / per[kept[0]]["cpu_s"]
        per["fused_speedup_cpu"] = per[kept[0]]["cpu_s"] / per[kept[2]]["cpu_s"]
        per["parameters"] = sum(p.numel() for g in sessions[name].optimizer.param_groups for p in g["params"])
    return out


def operator_profile(sessions: dict[str, Session], steps: int) -> dict:
    """name -> operator -> ``{"cpu_ms", "calls"}`` per step: the operators' own (self) CPU time
    and calls in ``steps`` whole steps of each session under ``torch.profiler`` (each session
    continues from a step number of its own beyond the timed ones)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in stepping(sessions, train_step, first=10_000).items():
        step()  # a warm step outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        out[name] = {
            e.key: {"cpu_ms": e.self_cpu_time_total / steps / 1e3, "calls": e.count / steps}
            for e in prof.key_averages()
            if e.self_cpu_time_total > 0
        }
    return out


def operator_rows(ops: dict, top: int = 12) -> list[str]:
    """Markdown: for each row after the first (the dense twin), its total own CPU ms and calls
    per step against the dense twin's, then the ``top`` operators whose own time grew most."""
    dense = next(iter(ops))

    def total(name: str, field: str) -> float:
        return sum(v[field] for v in ops[name].values())

    lines = []
    for name in ops:
        if name == dense:
            continue
        a, b = ops[dense], ops[name]
        lines += [
            "",
            f"{name} against {dense}: own CPU ms per step {total(dense, 'cpu_ms'):.1f} -> {total(name, 'cpu_ms'):.1f}, "
            f"operator calls {total(dense, 'calls'):,.0f} -> {total(name, 'calls'):,.0f}",
            "",
            f"| operator | {dense} ms | {dense} calls | {name} ms | {name} calls | difference ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        zero = {"cpu_ms": 0.0, "calls": 0.0}
        grown = sorted(set(a) | set(b), key=lambda k: a.get(k, zero)["cpu_ms"] - b.get(k, zero)["cpu_ms"])
        for k in grown[:top]:
            x, y = a.get(k, zero), b.get(k, zero)
            lines.append(
                f"| `{k}` | {x['cpu_ms']:.2f} | {x['calls']:.0f} | {y['cpu_ms']:.2f} | {y['calls']:.0f} "
                f"| {y['cpu_ms'] - x['cpu_ms']:+.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = arguments(__doc__, "a smoke run: baby, 2 rounds", (10, "interleaved rounds of each measurement"), 2)
    p.add_argument("--sizes", nargs="+", default=["baby", "large"], choices=["baby", "large"])
    p.add_argument("--labels", nargs="+", default=LABELS, help="study rows (the first must be dense)")
    p.add_argument("--optimizer-rounds", type=int, default=20, help="interleaved rounds of the AdamW-alone timing")
    p.add_argument("--compile", action="store_true", help="also time compiled sessions")
    p.add_argument("--torch-adamw", action="store_true", help="also time each row with torch's AdamW (the baseline)")
    p.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of each eager row (0: none)")
    p.add_argument(
        "--malloc-threshold",
        action="store_true",
        help="the trainer's default 1 MiB mmap threshold instead of the study's kept memory (cpu_malloc_keep)",
    )
    p.add_argument(
        "--frozen-routing",
        action="store_true",
        help="also time each MoE row with its routing frozen (freeze_routing): the step if routing cost nothing",
    )
    p.add_argument(
        "--shrunk",
        action="store_true",
        help="also time every row shrunk (SHRUNK: arithmetic made negligible): the step's fixed operator cost",
    )
    args, head = start("bench_step_phases", p, argv)
    if args.quick:
        args.sizes, args.rounds = ["baby"], 2
    info = setup_distributed("cpu")
    clocks = Clocks()
    result = {
        **head,
        "rounds": args.rounds,
        "burst": args.burst,
        "sizes": {
            size: bench(
                size,
                args.labels,
                args.compile,
                args.torch_adamw,
                args.rounds,
                args.burst,
                args.optimizer_rounds,
                args.profile_steps,
                not args.malloc_threshold,
                args.frozen_routing,
                args.shrunk,
                info,
            )
            for size in args.sizes
        },
    }
    return finish("bench_step_phases", result, args, markdown, clocks)


def markdown(r: dict) -> str:
    lines = [
        title("bench_step_phases", r),
        "",
        f"`{r['command']}`; medians of {r['rounds']} interleaved rounds ({r['burst']} steps each for whole steps).",
    ]
    for size, b in r["sizes"].items():
        lines += ["", f"## {size} ({b['tokens_per_step']} tokens a step)", ""]
        lines += steps_table(b["steps"], "vs")
        lines += fixed_cost_table(b["steps"])
        lines += ["", "Step phases, CPU ms (medians):", ""]
        lines += phases_table(b["phases"])
        names = list(b["phases"])
        totals = [sum(v["cpu_s"] for v in b["phases"][n].values()) * 1e3 for n in names]
        lines.append("| sum | " + " | ".join(f"{t:.2f}" for t in totals) + " |")
        if b["operators"]:
            lines += ["", "Operators under torch.profiler, own CPU time per step:"]
            lines += operator_rows(b["operators"])
        if not b["optimizer"]:
            continue
        lines += [
            "",
            "AdamW alone, CPU ms (medians): the loop's BlockedAdamW against torch's for-loop and fused AdamW:",
            "",
        ]
        lines += [
            "| run | parameters | BlockedAdamW | torch for-loop | torch fused | for-loop / Blocked | Blocked / fused | Blocked, ns per parameter |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for k, per in b["optimizer"].items():
            blocked, loop, fused = (per[v]["cpu_s"] * 1e3 for v in per if isinstance(per[v], dict))
            lines.append(
                f"| {k} | {per['parameters']:,} | {blocked:.2f} | {loop:.2f} | {fused:.2f} | {per['speedup_cpu']:.2f}x "
                f"| {per['fused_speedup_cpu']:.2f}x | {blocked * 1e6 / per['parameters']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def fixed_cost_table(steps: dict) -> list[str]:
    """Markdown (``--shrunk`` runs only): each row's CPU ms per step at the study's widths and
    shrunk, its gap over the dense row at each, and the shrunk gap's share of the full one."""
    labels = [k.removesuffix(" shrunk") for k in steps if k.endswith(" shrunk")]
    if not labels:
        return []
    ms = {k: v["cpu_s"] * 1e3 for k, v in steps.items()}
    lines = [
        "",
        "The fixed cost (`--shrunk`: the same rows at D 16, T 8, batch 2), CPU ms per step:",
        "",
        "| row | study widths | gap over dense | shrunk | gap over dense, shrunk | shrunk gap / gap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        gap, fixed = ms[label] - ms["dense"], ms[f"{label} shrunk"] - ms["dense shrunk"]
        share = f"{fixed / gap:.2f}" if label != "dense" and gap > 0 else "-"
        lines.append(
            f"| {label} | {ms[label]:.2f} | {gap:+.2f} | {ms[f'{label} shrunk']:.2f} | {fixed:+.2f} | {share} |"
        )
    return lines


if __name__ == "__main__":
    main()
