"""Trainer vs server log-probabilities per router of the router study, trained, with and without
exact mode and with routing replay (issue 56, item 4): which routers reach a difference of exactly
zero, and at what cost.

    PYTHONPATH=.:kernels nice -n 10 python experiments/exact_study.py       # trains the missing models first
    PYTHONPATH=.:kernels nice -n 10 python experiments/exact_study.py --routers topk_aux expert_choice --dtypes bf16

The models: per router of the study (``router_study.ROUTERS``, causal and leaking sets), the
study's row config (Shakespeare BPE, the baby size, seed 0, its recipe) trained ``--steps``
steps (default the recipe's 2,000: about 70 min of training for the twelve routers on 2 cores,
5-9 min a model per process; fewer steps compress the recipe's schedule to them: warmup the
same 5% of the steps, cosine to a tenth), the same for every
router, by ``routing_agreement.train_all`` (``--workers`` processes of one thread), exported to
``runs/exact_study/<steps>-steps/<router>-s0/model.pt``; a later run loads them and trains none.

The measurement, in eval mode on ``--windows`` validation windows of the study's 64 tokens, in
fp32 (the trained weights) and bf16 (the parameters cast, ``moe.agreement.cast_parameters``; the
routers keep their configured ``router_dtype``):

* server: decoding one token at a time through the KV cache (each token in the forward of its
  prefix for a router that cannot decode from a cache), recorded (``moe.agreement.run_decoding``);
* trainer: the teacher-forced forward of the same ids, in the same dtype.

The figure is max and mean |log p_server - log p_trainer| of each next token, for four trainers:
as is; replaying the server's recorded experts (``moe.replay_routing``); both sides inside
``moe.exact_mode()``; both exact and replaying. Cost: the process CPU time of the server and that
trainer over the normal server and trainer's (the least of ``--repeats`` decodings and of 5 forwards),
one thread,
the routers measured in ``--workers`` processes.

Writes ``experiments/results/exact_study-<date>-<steps>steps-cpu1.{json,md}`` and, when every
router is measured in both dtypes, the table in docs/studies.md between its markers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

import moe
from moe.agreement import cast_parameters, run_decoding, run_forward
from moe.exact import ExactnessWarning
from moe.training import load_export

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_study  # noqa: E402  (the study's routers, recipe and row config)
import routing_agreement  # noqa: E402  (training and exporting the study's rows)

LABELS = routing_agreement.LABELS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAINERS = ("as is", "replay", "exact", "exact + replay")
FORWARD_REPEATS = 5
RECIPE_STEPS = router_study.RECIPE["steps"]
"""Timed runs of each trainer forward (the least counts): one is tens of ms, too noisy alone."""
DOCS = router_study.ROOT / "docs" / "studies.md"
BEGIN, END = "<!-- exact_study table: written by experiments/exact_study.py -->", "<!-- /exact_study table -->"


def next_token_logp(logits_BTV: torch.Tensor, idx_BT: torch.Tensor) -> torch.Tensor:
    """float64 [B, T-1]: log p of each next token."""
    logp = torch.log_softmax(logits_BTV[:, :-1].double(), -1)
    return logp.gather(-1, idx_BT[:, 1:, None]).squeeze(-1)


def timed(repeats: int, fn, *args):
    """(fn(*args), the least process CPU time of ``repeats`` calls)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        out = fn(*args)
        best = min(best, time.process_time() - start)
    return out, best


def measure(model: torch.nn.Module, idx_BT: torch.Tensor, repeats: int) -> dict:
    """Each trainer's max and mean |Δ log p| against the server, and its cost."""
    gaps, seconds = {}, {}
    for exact in (False, True):
        with moe.exact_mode() if exact else nullcontext(), torch.no_grad():
            server, seconds["server", exact] = timed(repeats, run_decoding, model, idx_BT)
            trainer, seconds["trainer", exact] = timed(FORWARD_REPEATS, run_forward, model, idx_BT)
            with moe.replay_routing(model, server.record):
                replayed, seconds["replay", exact] = timed(FORWARD_REPEATS, run_forward, model, idx_BT)
        served = next_token_logp(server.logits, idx_BT)
        for name, run in (
            ("exact" if exact else "as is", trainer),
            ("exact + replay" if exact else "replay", replayed),
        ):
            gap = (next_token_logp(run.logits, idx_BT) - served).abs()
            gaps[name] = dict(max=gap.max().item(), mean=gap.mean().item())
    base = seconds["server", False] + seconds["trainer", False]
    parts = {"as is": ("trainer", False), "replay": ("replay", False), "exact": ("trainer", True)}
    parts["exact + replay"] = ("replay", True)
    for name, (trainer, exact) in parts.items():
        gaps[name]["cost"] = (seconds["server", exact] + seconds[trainer, exact]) / base
        gaps[name]["server_cost"] = seconds["server", exact] / seconds["server", False]
        gaps[name]["trainer_cost"] = seconds[trainer, exact] / seconds["trainer", False]
    return dict(
        server=server.how, trainers=gaps, seconds={f"{k}{' exact' if e else ''}": v for (k, e), v in seconds.items()}
    )


def validation_windows(label: str, num_windows: int) -> torch.Tensor:
    """int64 [W, 64]: the study's validation windows (``moe.data.eval_offsets``) of its corpus."""
    from moe.data import eval_offsets, windows
    from moe.training import TrainConfig

    fields = router_study.row_config("shakespeare-bpe", "baby", label, 0, quick=False)
    val = TrainConfig.flat(**fields).data.load().val
    return windows(val, eval_offsets(val.numel(), fields["seq_len"], num_windows), fields["seq_len"])[0]


def schedule(steps: int) -> dict:
    """The TrainConfig overrides of a row trained ``steps`` steps: the recipe's schedule compressed
    (warmup the same share of the steps), and a final evaluation of 8 windows (its summary's losses)."""
    warmup = router_study.RECIPE["warmup_steps"] * steps // RECIPE_STEPS
    return dict(steps=steps, warmup_steps=warmup, eval_windows=8, eval_batch_size=8)


def measure_router(label: str, runs: Path, dtypes: list[str], windows: int, repeats: int) -> list[dict]:
    """One row per dtype of the router's exported model (in a worker process, one thread)."""
    torch.set_num_threads(1)
    trained = routing_agreement.model_path(runs, label, 0)
    summary = json.loads(trained.with_name("summary.json").read_text())
    idx_BT = validation_windows(label, windows)
    rows = []
    for dtype in dtypes:
        model = load_export(trained)
        model = model if dtype == "fp32" else cast_parameters(model, DTYPES[dtype])
        with warnings.catch_warnings():  # the leaking routers say they cannot be exact: the table shows it
            warnings.simplefilter("ignore", ExactnessWarning)
            row = measure(model, idx_BT, repeats)
        rows.append(dict(dtype=dtype, router=label, teacher_forced_loss=summary["teacher_forced_loss"], **row))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routers", nargs="+", default=LABELS, choices=LABELS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=RECIPE_STEPS, help="training steps per router (the recipe's 2,000)")
    p.add_argument("--windows", type=int, default=4, help="validation windows of 64 tokens")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per path (the least counts)")
    p.add_argument("--workers", type=int, default=2, help="processes (training, then measuring), one thread each")
    p.add_argument("--out", type=Path, default=router_study.RESULTS)
    args = p.parse_args()
    runs = router_study.ROOT / "runs" / "exact_study" / f"{args.steps}-steps"
    routing_agreement.train_all(args.routers, 0, args.workers, False, runs, schedule(args.steps))
    jobs = [(label, runs, args.dtypes, args.windows, args.repeats) for label in args.routers]
    rows = [row for rows in routing_agreement.pool(measure_router, jobs, args.workers) for row in rows]
    rows.sort(key=lambda r: (args.dtypes.index(r["dtype"]), args.routers.index(r["router"])))
    table = write(args, rows)
    if sorted(args.routers) == sorted(LABELS) and sorted(args.dtypes) == sorted(DTYPES):
        replace_docs_table(DOCS, table)
        print(f"updated the table in {DOCS}", file=sys.stderr)


def cell(v: dict) -> str:
    return "**0**" if v["max"] == 0 else f"{v['max']:.2g} ({v['mean']:.1g})"


def cost(v: dict) -> str:
    return f"{v['cost']:.2f}x ({v['server_cost']:.2f}x / {v['trainer_cost']:.2f}x)"


def table_lines(rows: list[dict], windows: int, steps: int, stamp: str) -> list[str]:
    positions = windows * 63
    return [
        f"max |Δ log p| over {positions} next tokens ({windows} validation windows of 64; mean in brackets); "
        f"**0** = bit for bit the server's. Models trained {steps:,} steps each, seed 0 ("
        + ("the recipe" if steps == RECIPE_STEPS else f"the recipe's schedule compressed from {RECIPE_STEPS:,} steps")
        + "). Cost: CPU time of server + trainer over "
        "the normal pair's (in brackets: the server's / the trainer's alone, its least of 5 forwards), one thread, "
        "on a loaded shared "
        f"machine ({stamp}, torch {torch.__version__}).",
        "",
        "| dtype | router | " + " | ".join(TRAINERS) + " | replay cost | exact cost | exact + replay cost |",
        "|---|---|" + "---|" * len(TRAINERS) + "---:|---:|---:|",
        *(
            f"| {r['dtype']} | {r['router']} | "
            + " | ".join(cell(r["trainers"][t]) for t in TRAINERS)
            + "".join(f" | {cost(r['trainers'][t])}" for t in TRAINERS[1:])
            + " |"
            for r in rows
        ),
    ]


def write(args: argparse.Namespace, rows: list[dict]) -> list[str]:
    stamp = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"exact_study-{stamp}-{args.steps}steps-cpu1"
    meta = dict(date=stamp, torch=torch.__version__, steps=args.steps, windows=args.windows, repeats=args.repeats)
    base.with_suffix(".json").write_text(json.dumps(dict(**meta, rows=rows), indent=2) + "\n")
    table = table_lines(rows, args.windows, args.steps, stamp)
    lines = [f"# Trainer vs server log p of the trained study routers ({stamp})", "", *table, ""]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return table


def replace_docs_table(path: Path, table: list[str]) -> None:
    """Put ``table`` between the markers of ``path`` (ValueError naming them where they are missing)."""
    text = path.read_text()
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{path} has no {BEGIN} ... {END} markers to hold the table")
    path.write_text(head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail)


if __name__ == "__main__":
    main()
