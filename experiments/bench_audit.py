"""The cost of ``moe.audit.audit`` per probe and per target, in forwards of the target measured in
the same run; prints a table and, with --json, writes it.

    python experiments/bench_audit.py                                   # the targets below, both modes
    python experiments/bench_audit.py --json experiments/results/bench_audit-after.json
    PYTHONPATH=/path/to/older/checkout python experiments/bench_audit.py --json before.json
    python experiments/bench_audit.py --compare before.json after.json  # side by side, no audit run
    python experiments/bench_audit.py --quick                           # the pre-commit check's cost
    python experiments/bench_audit.py --user-path                       # what a user pays: the command, assert_causal

One forward-equivalent is the median time of one eval-mode forward of the target on its example
under ``torch.no_grad()`` (30 runs after 5 warm-up runs, measured before and after the audit and
the smaller median kept): the audit's time per probe (its forwards, backwards, comparisons and
input building; calibration is its own row) divided by it. Times are this process's CPU time
(process CPU time from ``experiments/timing.py``, one torch thread), not wall time: on a machine shared with other jobs
the wall clock also counts the time the process waits for a core, which varies by several times
from one run to the next. The ratio is measured within one process; the before/after comparison
sets two such ratios side by side. ``wall_s`` is kept for reference.
``--user-path`` measures what docs/audit-ci.md quotes, for the MoELayer block there (one forward
about a millisecond): ``moe-audit --target`` as a user runs it (the CPU time of the whole
command, its start-up, imports included, measured apart as ``python -c "import
moe.audit.cli"``), and ``assert_causal`` in a process (its first call, then later calls), each
also in forwards of the block; medians of ``--repeats`` runs.
The script only wraps functions both versions of the audit have (``engine._run``,
``engine.calibrate``, ``runner.Runner._run``), so it runs against an older checkout unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

# this tree's timing harness, appended so that PYTHONPATH still chooses which moe is measured
sys.path.append(str(Path(__file__).resolve().parents[1]))
import moe.audit.engine as engine  # noqa: E402
import moe.audit.runner as runner_module  # noqa: E402
from experiments.timing import Clocks, interleaved, timed  # noqa: E402
from moe.audit import audit  # noqa: E402
from moe.audit.report import yes_no  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402

B, T, D, E = 4, 32, 32, 4


class HandTop2(nn.Module):
    """A top-2 block as a newcomer writes it: a linear gate, softmax, top-2, a loop over experts
    that gathers each expert's tokens and adds their weighted outputs back (opaque to the audit:
    no router class, no claims). ``dropout``: each expert's output over its batch of tokens."""

    def __init__(self, d: int = D, experts: int = E, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.Dropout(dropout))
            for _ in range(experts)
        )

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(-1, d)
        w_NK, idx_NK = self.gate(x_ND).softmax(-1).topk(2, dim=-1)
        y_ND = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts):
            n, k = (idx_NK == e).nonzero(as_tuple=True)
            y_ND = y_ND.index_add(0, n, w_NK[n, k, None] * expert(x_ND[n]))
        return y_ND.reshape(b, t, d)


class DenseDispatchTop1(nn.Module):
    """GShard-style top-1 with a dense [N, E, C] dispatch tensor, C = N (nothing dropped): its
    cost grows with the square of the token count N (the packing case of the audit)."""

    def __init__(self, d: int = D, experts: int = E) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(experts, d, d) / math.sqrt(d))

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(-1, d)
        n, e = x_ND.shape[0], self.w_EDD.shape[0]
        probs_NE = self.gate(x_ND).softmax(-1)
        onehot_NE = nn.functional.one_hot(probs_NE.argmax(-1), e).to(x_ND.dtype)
        slot_N = ((onehot_NE.cumsum(0) - 1) * onehot_NE).sum(-1).long()
        dispatch_NEC = onehot_NE[..., None] * nn.functional.one_hot(slot_N, n).to(x_ND.dtype)[:, None]
        expert_out_ECD = torch.tanh(
            torch.einsum("ecd,edf->ecf", torch.einsum("nec,nd->ecd", dispatch_NEC, x_ND), self.w_EDD)
        )
        y_ND = torch.einsum("nec,ecd->nd", dispatch_NEC * probs_NE[..., None], expert_out_ECD)
        return y_ND.reshape(b, t, d)


def _floats() -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))


def _short_floats() -> Tensor:
    return torch.randn(B, 16, D, generator=torch.Generator().manual_seed(0))


def _tokens() -> Tensor:
    return torch.randint(0, preset("tiny").vocab_size, (B, 16), generator=torch.Generator().manual_seed(0))


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return make


TARGETS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "topk_layer": (_seeded(lambda: MoELayer(D, 2 * D, E, router="topk", top_k=2)), _floats),
    "expert_choice_layer": (_seeded(lambda: MoELayer(D, 2 * D, E, router="expert_choice")), _floats),
    "hand_top2_block": (_seeded(HandTop2), _floats),
    "capacity_batch_layer": (
        _seeded(lambda: MoELayer(D, 2 * D, E, router="capacity", priority="position", group="batch")),
        _floats,
    ),
    "hand_top2_dropout": (_seeded(lambda: HandTop2(dropout=0.1)), _floats),
    "dense_dispatch_top1": (_seeded(DenseDispatchTop1), _short_floats),
    "tiny_model_topk": (_seeded(lambda: MoETransformer(preset("tiny", router="topk"))), _tokens),
}
"""name -> (build, example): the issue's three (B=4, T=32, D=32: a top-k and an expert-choice
MoELayer, a hand-written top-2 block), a layer whose capacity is counted over the batch (clean
but batch-dependent: nothing can share a forward), a block random in training, a dispatch whose
cost is quadratic in the tokens (on [4, 16, 32]: a pack of 128 copies holds a 1 GiB dispatch
tensor), and the tiny model on token ids."""


def one_forward_s(target: nn.Module, x: Tensor, reps: int = 30, warmup: int = 5) -> float:
    target.eval()
    with torch.no_grad():
        samples = interleaved({"forward": lambda: target(x.clone())}, reps, warmup=warmup)
    return samples["forward"].median("cpu")


class Meter:
    """Times each probe and the calibration, and counts forwards, by wrapping the audit's own
    functions (restored on exit)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.forwards: dict[str, int] = defaultdict(int)
        self.samples: dict[str, int] = defaultdict(int)
        self._current = "calibration"

    def __enter__(self) -> Meter:
        self._saved = (engine._run, engine.calibrate, runner_module.Runner._run)
        run_probe, calibrate, run_target = self._saved
        meter = self

        def timed_probe(probe, comparator, ctx, session):  # noqa: ANN001, ANN202
            meter._current, clocks = probe.name, Clocks()
            try:
                return run_probe(probe, comparator, ctx, session)
            finally:
                meter.seconds[probe.name] += clocks.lap()[1]
                meter._current = "other"

        def timed_calibration(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            meter._current, clocks = "calibration", Clocks()
            try:
                return calibrate(*args, **kwargs)
            finally:
                meter.seconds["calibration"] += clocks.lap()[1]
                meter._current = "other"

        def counted(self_runner, x, seed, call):  # noqa: ANN001, ANN202
            meter.forwards[meter._current] += 1
            meter.samples[meter._current] += x.shape[0]
            return run_target(self_runner, x, seed, call)

        engine._run, engine.calibrate, runner_module.Runner._run = timed_probe, timed_calibration, counted
        return self

    def __exit__(self, *exc: object) -> None:
        engine._run, engine.calibrate, runner_module.Runner._run = self._saved


def bench(name: str, trials: int, seed: int, quick: bool) -> dict:
    build, example = TARGETS[name]
    target, x = build(), example()
    before_s = one_forward_s(target, x)
    options = {"quick": True} if quick else {"trials": trials}  # the older audit has no quick
    with Meter() as meter:
        report, wall, cpu = timed(lambda: audit(target, x, seed=seed, name=name, **options))
    unit = min(before_s, one_forward_s(target, x))
    accounted = sum(meter.seconds.values())
    meter.seconds["other"] += max(0.0, cpu - accounted)
    return {
        "target": name,
        "input": list(x.shape),
        "one_forward_ms": round(unit * 1e3, 4),
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "forward_equivalents": round(cpu / unit, 1),
        "forwards": sum(meter.forwards.values()),
        "samples_run": sum(meter.samples.values()),
        "per_probe": {
            k: {
                "forward_equivalents": round(v / unit, 1),
                "forwards": meter.forwards.get(k, 0),
                "samples_run": meter.samples.get(k, 0),
            }
            for k, v in sorted(meter.seconds.items())
        },
        "verdict": {
            "error": report.error,
            "leaks_in": report.leaks_in,
            "batch_invariant": report.batch_invariant,
            "decode_consistent": report.decode_consistent,
            "regime": report.regime,
        },
    }


USER_BLOCK = """
import torch
from moe import MoELayer


def build_block():
    torch.manual_seed(0)
    return MoELayer(32, 64, 4, router="topk", top_k=2)
"""
"""The block of docs/audit-ci.md, as a user's file for ``moe-audit --target``."""


def _child_cpu(argv: list[str], env: dict) -> tuple[float, str]:
    """(CPU seconds, user and system, of one child process; its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def user_path(repeats: int) -> dict:
    """What docs/audit-ci.md quotes: the command and assert_causal on the block there."""
    from moe.audit import assert_causal

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, "block.py")
        with open(file, "w") as f:
            f.write(USER_BLOCK)
        command = [sys.executable, "-m", "moe.audit", "--target", f"{file}:build_block", "--input", "float:4,16,32"]
        runs = [_child_cpu([*command, "--no-progress"], env) for _ in range(repeats)]
        startup = [_child_cpu([sys.executable, "-c", "import moe.audit.cli"], env)[0] for _ in range(repeats)]
    reported = [float(out.split(" forward-equivalents")[0].rsplit(" ", 1)[-1]) for _, out in runs]
    namespace: dict = {}
    exec(USER_BLOCK, namespace)
    block, x = namespace["build_block"](), torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    unit = one_forward_s(block, x)
    calls = [timed(lambda: assert_causal(block, x, batch_invariant=True))[2] for _ in range(repeats + 1)]
    unit = min(unit, one_forward_s(block, x))
    command_s = statistics.median(c for c, _ in runs)
    return {
        "one_forward_ms": round(unit * 1e3, 3),
        "command_cpu_s": round(command_s, 2),
        "command_startup_cpu_s": round(statistics.median(startup), 2),
        "command_forward_equivalents": round(command_s / unit),
        "command_reported_forward_equivalents": statistics.median(reported),
        "assert_causal_first_cpu_s": round(calls[0], 3),
        "assert_causal_first_forward_equivalents": round(calls[0] / unit),
        "assert_causal_later_cpu_s": round(statistics.median(calls[1:]), 3),
        "assert_causal_later_forward_equivalents": round(statistics.median(calls[1:]) / unit),
    }


def print_rows(rows: list[dict]) -> None:
    probes = sorted({p for r in rows for p in r["per_probe"]})
    head = ["target", "1 fwd ms", "fwd-eq", "forwards", *probes, "leaks in", "batch-inv", "decode"]
    lines = [head]
    for r in rows:
        v = r["verdict"]
        lines.append(
            [
                r["target"],
                f"{r['one_forward_ms']:.2f}",
                f"{r['forward_equivalents']:.0f}",
                str(r["forwards"]),
                *(f"{r['per_probe'].get(p, {}).get('forward_equivalents', 0):.0f}" for p in probes),
                ",".join(v["leaks_in"]) or ("ERROR" if v["error"] else "-"),
                yes_no(v["batch_invariant"]),
                yes_no(v["decode_consistent"]),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


def compare(before: dict, after: dict) -> None:
    by_name = {r["target"]: r for r in before["rows"]}
    print(f"before: {before['meta']}\nafter:  {after['meta']}")
    head = ["target", "fwd-eq before", "fwd-eq after", "ratio", "forwards before", "forwards after", "same verdict"]
    lines = [head]
    for r in after["rows"]:
        b = by_name.get(r["target"])
        if b is None:
            continue
        same = {k: b["verdict"][k] for k in ("leaks_in", "batch_invariant", "decode_consistent")} == {
            k: r["verdict"][k] for k in ("leaks_in", "batch_invariant", "decode_consistent")
        }
        lines.append(
            [
                r["target"],
                f"{b['forward_equivalents']:.0f}",
                f"{r['forward_equivalents']:.0f}",
                f"{r['forward_equivalents'] / b['forward_equivalents']:.2f}",
                str(b["forwards"]),
                str(r["forwards"]),
                "yes" if same else "NO",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of the targets")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="audit(..., quick=True): the pre-commit check")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and the conditions) as JSON")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print two JSON files side by side")
    p.add_argument("--user-path", action="store_true", help="the command and assert_causal on docs/audit-ci.md's block")
    p.add_argument("--repeats", type=int, default=3, help="--user-path: runs of each (their median)")
    args = p.parse_args(argv)
    if args.user_path:
        torch.set_num_threads(1)
        print(json.dumps({"load_average": os.getloadavg(), **user_path(args.repeats)}, indent=2))
        return
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        compare(before, after)
        return
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    # One-time imports (torch._dynamo and sympy for recording random draws, which only a target that draws loads).
    audit(nn.Sequential(nn.Linear(D, D), nn.Dropout(0.1)), torch.randn(2, 4, D), modes=("train",))
    rows = [bench(n, args.trials, args.seed, args.quick) for n in names]
    print_rows(rows)
    if args.json:
        meta = {
            "audit_source": os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__))),
            "torch": torch.__version__,
            "threads": args.threads,
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "argv": sys.argv[1:],
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
