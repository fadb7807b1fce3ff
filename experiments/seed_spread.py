"""How long must the packet-loss study's model train before runs that differ only in their seed
(initialisation and batch order) agree on validation perplexity? The reliable data-parallel run
of ``experiments/packet_loss.py`` equals one process on the same global batch (to fp32
rounding, ``tests/test_parallel_train.py``), so one process measures it.

    python experiments/seed_spread.py --steps 300 1000 2000 --seeds 0 1 2 \
        --json experiments/results/seed_spread-2026-11-29.json

Per step count: every seed's final teacher-forced validation loss and perplexity, the spread
(largest perplexity over smallest, minus 1) and the standard deviation of the perplexities in
percent of their mean. A perplexity change of c% between two configurations is visible in one
pair of runs only when this spread is well under c%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from datetime import date
from pathlib import Path

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments import rows as runner  # noqa: E402
from experiments.timing import Clocks  # noqa: E402
from moe.data import load_corpus  # noqa: E402
from moe.training import TrainConfig, train  # noqa: E402


def table(rows: list[dict]) -> str:
    return "\n".join(
        ["| steps | seeds | val ppl per seed | spread % | sd % | wall s |", "|---|---|---|---|---|---|"]
        + [
            f"| {r['steps']} | {len(r['seeds'])} | {', '.join(f'{v:.3f}' for v in r['val_ppl'])} | {r['spread_pct']:.2f} | "
            f"{r['sd_pct']:.2f} | {r['wall_s']:.0f} |"
            for r in rows
        ]
    )


def write(rows: list[dict], args: argparse.Namespace, provenance: dict) -> dict:
    result = {
        "date": date.today().isoformat(),
        "preset": args.preset,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "rows": rows,
        **provenance,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        args.json.with_suffix(".md").write_text(table(rows) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[300, 1000, 2000])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--json", type=Path, help="write the results here (and a .md table next to it)")
    args = p.parse_args(argv)
    if len(args.seeds) < 2 or min(args.steps) <= 0:
        p.error("need at least two seeds and positive step counts")
    corpus = load_corpus("stdlib", max_bytes=4_000_000)  # packet_loss.py's corpus
    ran = runner.provenance(runner.command("experiments/seed_spread.py", sys.argv[1:] if argv is None else argv))

    def run_seed(spec: dict) -> dict:
        cfg = TrainConfig.flat(
            preset=args.preset,
            steps=spec["steps"],
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            seed=spec["seed"],
            warmup_steps=min(30, spec["steps"] // 10),
            eval_windows=args.eval_windows,
            log_every=0,
            progress=False,
            wandb_mode="disabled",
        )
        return {"loss": train(cfg, corpus).final_eval["teacher_forced_loss"], "config": cfg}

    rows = []
    for steps in args.steps:
        clocks = Clocks()
        runs: list[dict] = []
        runner.run_rows(run_seed, [{"steps": steps, "seed": seed} for seed in args.seeds], 0, runs.append)
        losses, cfg = [r["loss"] for r in runs], runs[-1]["config"]
        ppl = [math.exp(v) for v in losses]
        row = {
            "steps": steps,
            "seeds": args.seeds,
            "val_loss": losses,
            "val_ppl": ppl,
            "spread_pct": 100 * (max(ppl) / min(ppl) - 1),
            "sd_pct": 100 * statistics.stdev(ppl) / statistics.mean(ppl),
            "wall_s": clocks.lap()[0],
            "config": dataclasses.asdict(cfg),
        }  # the last seed's; the others differ only in seed
        rows.append(row)
        print(
            f"{steps:6d} steps: ppl {', '.join(f'{v:.3f}' for v in ppl)}; spread {row['spread_pct']:.2f}%, "
            f"sd {row['sd_pct']:.2f}% ({row['wall_s']:.0f}s)",
            flush=True,
        )
        result = write(rows, args, ran)  # after every length: a long run keeps what it measured
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
