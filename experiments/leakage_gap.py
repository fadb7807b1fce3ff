"""What does a router's leak cost? Train the same tiny MoE LM with each router family and
compare, on the same validation positions, the teacher-forced loss (full-sequence forward in
eval mode) with the causal loss (position t computed from the prefix 0..t alone, as decoding
does). Their difference is the leakage gap.

    python experiments/leakage_gap.py --quick          # 2.5 min on 2 shared CPU cores
    python experiments/leakage_gap.py                  # the committed full run (18 min on 2 shared CPU cores)
    python experiments/leakage_gap.py --corpora canary --routers topk expert_choice --canary-steps 3000
    python experiments/leakage_gap.py --data path/to/texts --json runs/gap.json
    python experiments/leakage_gap.py --corpora text --data data/mine     # a prepared directory (python -m moe.data prepare)
    python experiments/leakage_gap.py --replot experiments/results/leakage_gap.json
    python experiments/leakage_gap.py --update experiments/results/leakage_gap.json --routers capacity_prefix
    python experiments/leakage_gap.py --update experiments/results/leakage_gap.json --routers token_rounding --corpora text

Two corpora: ``text`` (byte-level Python standard library source, ``--data PATH`` of text, or a
prepared token directory, whose vocabulary the model then has) and
``canary`` (uniformly random tokens over V=8: no causal model can beat log 8 nats, so any
teacher-forced loss below it is information taken from the future). The causal loss is what
decoding computes: through the KV cache for routers that can decode from a state, by
recomputing every prefix for those that cannot (``moe.eval.evaluate``; the row's
``causal_method``), the evaluation windows batched. On text it is read at every 8th position
in the quick run and at every position in the full run; on the canary at every position.

Writes ``--json`` (``{"routers": [{"router", "corpus", "teacher_forced_loss", "causal_loss",
"leakage_gap", ..., "sample"}]}``, the sample: text greedily decoded after the start of the
validation split, through the data's tokenizer, also printed for the text corpus), a markdown
table and a figure (loss curves and gap bars) next to it.
Rows run through ``experiments/rows.py`` in ``--workers`` processes with one thread each (tiny models
run fastest that way); each records its commit, machine, command and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments import rows as runner  # noqa: E402
from experiments.timing import Clocks  # noqa: E402
from moe.agreement import train_serve_agreement  # noqa: E402
from moe.eval import eval_offsets, evaluate, format_difference, windows  # noqa: E402
from moe.extras import pyplot  # noqa: E402
from moe.routers import build_router  # noqa: E402
from moe.training import TrainConfig, train  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_PROMPT, SAMPLE_NEW = 32, 48
"""Tokens of the prompt (the start of the validation split) and greedily decoded tokens of each row's sample."""

ROUTERS: dict[str, tuple[str, dict]] = {
    # label: (registered router name, options). Capacity factor 1 everywhere: leaks need contention.
    "topk": ("topk", {"top_k": 2}),
    "capacity_position": ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "position"}),
    # position priority with the capacity of the prefix 0..t: causal *and* decode-consistent
    "capacity_prefix": (
        "capacity",
        {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "capacity_scope": "prefix"},
    ),
    "capacity_score": ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "score"}),
    "expert_choice": ("expert_choice", {"capacity_factor": 1.0}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 1.0}),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 1.0}),
    # SonicMoE's token rounding: counts rounded to tiles of 128 in training (text: ~1024 tokens per expert), top-k served
    "token_rounding": ("token_rounding", {"top_k": 2, "tile_size": 128}),
}


@dataclass(frozen=True)
class Budget:
    """Steps and evaluation size of one corpus."""

    steps: int
    eval_windows: int
    causal_stride: int


FULL = {
    "canary": Budget(steps=5000, eval_windows=2048, causal_stride=1),
    "text": Budget(steps=1500, eval_windows=64, causal_stride=1),
}
QUICK = {
    "canary": Budget(steps=500, eval_windows=1024, causal_stride=1),
    "text": Budget(steps=100, eval_windows=32, causal_stride=8),
}


def corpus_config(corpus: str, budget: Budget, args: argparse.Namespace) -> dict:
    """TrainConfig fields of one corpus (the model is the ``tiny`` preset in both)."""
    common = dict(
        preset="tiny",
        seed=args.seed,
        steps=budget.steps,
        eval_windows=budget.eval_windows,
        causal_stride=budget.causal_stride,
        log_every=0,
        progress=False,
        wandb_mode="disabled",
    )
    if corpus == "canary":
        # The planning measurement's setting: V=8, T=8, batch 64, 2 layers d=64, 4 experts.
        return dict(
            common,
            data="canary",
            canary_vocab=8,
            max_bytes=2_000_000,
            seq_len=8,
            batch_size=64,
            lr=args.canary_lr,
            warmup_steps=100,
            eval_batch_size=64,
        )
    return dict(
        common,
        data=args.data,
        seq_len=128,
        batch_size=16,
        lr=3e-3,
        warmup_steps=min(100, budget.steps // 10),
        eval_batch_size=16,
    )


def row_key(row: dict) -> tuple[str, str]:
    """A row's identity in a results JSON: its corpus and router label (a rerun replaces it)."""
    return row["corpus"], row["router"]


def run_row(spec: dict) -> dict:
    """Train one (router, corpus) pair of ``spec`` and evaluate it; runs in a worker process."""
    torch.set_num_threads(1)
    label, corpus = spec["router"], spec["corpus"]
    name, options = ROUTERS[label]
    cfg = TrainConfig.flat(router=name, router_options=options, **spec["fields"])
    res = train(cfg)
    data = cfg.data.load()
    val = data.val
    train_mode = evaluate(
        res.model,
        val,
        cfg.data.seq_len,
        cfg.eval.eval_windows,
        cfg.eval.causal_stride,
        cfg.eval.eval_batch_size,
        causal=False,
        with_train_mode=True,
    )
    ev = {**res.final_eval, "train_mode_loss": train_mode["train_mode_loss"]}
    idx_WT, _ = windows(val, eval_offsets(val.numel(), cfg.data.seq_len, cfg.eval.eval_windows), cfg.data.seq_len)
    train_serve = train_serve_agreement(res.model, idx_WT[: cfg.eval.eval_batch_size])  # one evaluation batch
    claims = res.model.blocks[0].ffn.router.claims
    causal_method = "cache" if res.model.eval().decode_support() is None else "recompute"
    with torch.no_grad():  # greedy, from the start of the validation split, as decoding sees it
        sample = res.model.generate(
            val[torch.arange(SAMPLE_PROMPT)].long().view(1, -1),
            SAMPLE_NEW,
            temperature=0,
            recompute=causal_method == "recompute",
        )[0]
    return {
        "router": label,
        "router_name": name,
        "router_options": options,
        "corpus": corpus,
        "claims_causal_eval": claims.causal_eval,
        "claims_causal_train": claims.causal_train,
        "causal_method": causal_method,
        **{
            k: ev[k]
            for k in (
                "teacher_forced_loss",
                "causal_loss",
                "leakage_gap",
                "leakage_gap_se",
                "train_mode_loss",
                "eval_positions",
            )
        },
        "train_serve_agreement": train_serve.share,
        "final_train_loss": sum(r["loss"] for r in res.history[-50:]) / len(res.history[-50:]),
        "train_time_s": res.train_time_s,
        "steps": cfg.optimizer.steps,
        "loss_curve": [r["loss"] for r in res.history],
        "sample": data.decode(sample),
        "config": dataclasses.asdict(cfg),
        **{k: spec[k] for k in ("commit", "command", "date")},
        "machine": runner.machine(),
    }


def markdown_table(rows: list[dict], quick: bool, wall_s: float) -> str:
    lines = [
        f"Leakage gap ({'quick' if quick else 'full'} run, {wall_s / 60:.1f} min wall). Losses in nats on the same "
        "validation positions. gap = causal - teacher-forced, both with eval-mode routing (± standard error over "
        "positions); train-mode = teacher-forced with training-mode routing (what the training curve shows); "
        "train-mode gap = causal - train-mode. Canary floor: log 8 = 2.0794.",
        "",
        "| corpus | router | claims causal (train/eval) | claims decode-consistent | teacher-forced | causal | gap | "
        "train-mode | train-mode gap | positions | steps | train time (s) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    yes = {True: "yes", False: "no"}
    for r in rows:
        claims = build_router(r["router_name"], d_model=8, num_experts=4, **r["router_options"]).claims
        claim = f"{yes[claims.causal_train]}/{yes[claims.causal_eval]} | {yes[claims.decode_consistent]}"
        lines.append(
            f"| {r['corpus']} | {r['router']} | {claim} | {r['teacher_forced_loss']:.4f} | {r['causal_loss']:.4f} | "
            f"{format_difference(r['leakage_gap'])} ± {r['leakage_gap_se']:.4f} | {r['train_mode_loss']:.4f} | "
            f"{format_difference(r['train_mode_gap'])} | {r['eval_positions']} | {r['steps']} | {r['train_time_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], corpora: list[str], path: Path) -> None:
    plt = pyplot("the leakage-gap figure")

    fig, axes = plt.subplots(len(corpora), 2, figsize=(12, 4 * len(corpora)), squeeze=False)
    for i, corpus in enumerate(corpora):
        sub = [r for r in rows if r["corpus"] == corpus]
        ax = axes[i][0]
        for r in sub:
            curve = torch.tensor(r["loss_curve"])
            k = max(1, len(curve) // 100)
            smooth = curve[: len(curve) // k * k].view(-1, k).mean(1)
            ax.plot(torch.arange(len(smooth)) * k + k, smooth, label=r["router"])
        if corpus == "canary":
            ax.axhline(math.log(8), color="k", ls="--", lw=1, label="log 8 (causal floor)")
        ax.set(title=f"{corpus}: training loss", xlabel="step", ylabel="loss (nats)")
        lo = min(min(r["loss_curve"]) for r in sub)
        ax.set_ylim(lo - 0.05, lo + (0.5 if corpus == "canary" else 2.5))
        ax.legend(fontsize=8)
        ax = axes[i][1]
        x = torch.arange(len(sub)).double()
        ax.bar(
            x - 0.2,
            [r["leakage_gap"] for r in sub],
            width=0.4,
            yerr=[2 * r["leakage_gap_se"] for r in sub],
            capsize=3,
            color="tab:red",
            label="causal - teacher-forced (eval routing, ±2 se)",
        )
        ax.bar(
            x + 0.2,
            [r["train_mode_gap"] for r in sub],
            width=0.4,
            color="tab:gray",
            label="causal - train-mode teacher-forced",
        )
        names = [r["router"] + ("" if r["claims_causal_eval"] else " *") for r in sub]
        ax.set_xticks(x.tolist(), names, rotation=30, ha="right", fontsize=8)
        ax.axhline(0, color="k", lw=0.8)
        ax.set(title=f"{corpus}: what decoding loses (* claims: not causal in eval)", ylabel="gap (nats)")
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict, json_path: Path) -> str:
    """Write the JSON, the markdown table (.md) and the figure (.png); return the table."""
    for r in result["routers"]:
        r["train_mode_gap"] = r["causal_loss"] - r["train_mode_loss"]
        r["loss_curve"] = [round(v, 4) for v in r["loss_curve"]]
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(result["routers"], result["quick"], result["wall_time_s"])
    json_path.with_suffix(".md").write_text(table)
    plot(result["routers"], list(result["budgets"]), json_path.with_suffix(".png"))
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and positions (< 5 min on 2 CPU cores)")
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument(
        "--corpora", nargs="+", choices=["canary", "text"], help="default: both; with --update, the JSON's corpora"
    )
    p.add_argument(
        "--data", default="stdlib", help="text corpus: 'stdlib', a text path or a prepared directory (default: stdlib)"
    )
    p.add_argument("--canary-steps", type=int, help="override the canary's training steps")
    p.add_argument("--text-steps", type=int, help="override the text corpus's training steps")
    p.add_argument("--canary-lr", type=float, default=3e-3, help="peak learning rate on the canary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="training processes (one thread each; 0: in this process)")
    p.add_argument(
        "--json",
        type=Path,
        help="results JSON; the .md table and .png figure go next to it "
        "(default: experiments/results/leakage_gap[_quick].json)",
    )
    p.add_argument("--replot", type=Path, metavar="JSON", help="only re-render the table and figure of a results JSON")
    p.add_argument(
        "--update",
        type=Path,
        metavar="JSON",
        help="run --routers (default: all) on --corpora (default: the JSON's) with the budgets of this results JSON "
        "and replace or add their rows",
    )
    args = p.parse_args(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        print(render(result, args.replot))
        return result
    previous = json.loads(args.update.read_text()) if args.update else None
    stored = [] if previous is None else list(previous["budgets"])
    if previous is not None:
        args.quick = previous["quick"]
    args.corpora = args.corpora or stored or ["canary", "text"]
    budgets = dict(QUICK if args.quick else FULL)
    if previous is not None:
        budgets = {c: Budget(**b) for c, b in previous["budgets"].items()}
    for corpus, steps in (("canary", args.canary_steps), ("text", args.text_steps)):
        if steps is not None:
            b = budgets[corpus]
            budgets[corpus] = Budget(steps, b.eval_windows, b.causal_stride)
    json_path = args.update or args.json or RESULTS / ("leakage_gap_quick.json" if args.quick else "leakage_gap.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for label in args.routers:  # fail fast on a bad router before any process starts
        build_router(ROUTERS[label][0], d_model=8, num_experts=4, **ROUTERS[label][1])

    ran = runner.provenance(runner.command("experiments/leakage_gap.py", sys.argv[1:] if argv is None else argv))
    specs = [
        {"router": label, "corpus": corpus, "fields": corpus_config(corpus, budgets[corpus], args)}
        | {k: ran[k] for k in ("commit", "command", "date")}
        for corpus in args.corpora
        for label in args.routers
    ]
    clocks = Clocks()
    rows: list[dict] = []

    def store(r: dict) -> None:
        rows.append(r)
        tqdm.write(
            f"{r['corpus']:>6} {r['router']:<18} tf {r['teacher_forced_loss']:.4f}  "
            f"causal {r['causal_loss']:.4f}  gap {format_difference(r['leakage_gap'])}  ({r['train_time_s']:.0f} s)"
        )
        if r["corpus"] == "text":
            tqdm.write(f"{'':>6} {r['router']} sample: {r['sample']!r}")

    runner.run_rows(run_row, specs, args.workers, store, desc="routers x corpora")
    wall = clocks.lap()[0]
    if previous is not None:
        rows = runner.merge(previous["routers"], rows, key=row_key)
        wall += previous["wall_time_s"]
    order = {key: i for i, key in enumerate((c, r) for c in budgets for r in ROUTERS)}
    rows.sort(key=lambda r: order[(r["corpus"], r["router"])])

    result = {
        "quick": args.quick,
        "wall_time_s": wall,
        "torch": torch.__version__,
        "budgets": {c: vars(budgets[c]) for c in dict.fromkeys([*stored, *args.corpora])},
        "routers": rows,
    }
    table = render(result, json_path)
    print(table)
    print(f"wrote {json_path}, {json_path.with_suffix('.md')}, {json_path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
