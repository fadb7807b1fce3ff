"""Which routers does low precision move? One model per router of the router study, trained with
the study's own row config (``router_study.row_config``: Shakespeare BPE, the baby size, the
study's recipe, seed 0), then each model's routing of the study's validation windows along the
paths that part ways between an inference engine and a trainer:

* fp32 teacher-forced: one full forward in fp32 (what the trainer computes);
* fp32 decoding: one token at a time through the KV cache (each token in the forward of its
  prefix for routers that cannot decode from a cache: expert choice);
* bf16 decoding, two ways: bf16 weights with the router in bf16 (``router_dtype="input"``, the
  engine that routes in its model's precision), and bf16 weights with an fp32 router (the
  package's default ``router_dtype``).

Per router: the agreement (share of (token, layer) pairs routed to the same expert set) of each
pair of paths, the causal loss each decoding serves, and the trainer's loss and per-token
log-probability mismatch against the served tokens with and without routing replay (the fp32
forward routed with the bf16 decoding's recorded experts, ``moe.replay_routing``).

    nice -n 15 python experiments/routing_agreement.py train --workers 2      # the study's baby rows, exported
    nice -n 15 python experiments/routing_agreement.py measure --workers 2    # results JSON + markdown
    python experiments/routing_agreement.py measure --routers topk_aux expert_choice --windows 8
    python experiments/routing_agreement.py --quick train && python experiments/routing_agreement.py --quick measure

``--quick`` (the test's run): the study's quick size and recipe on the standard library's bytes,
models under runs/routing_agreement_quick, results in experiments/results/routing_agreement_quick.*.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_study  # noqa: E402  (the study's routers, sizes, recipe, corpus and row config)

ROOT = router_study.ROOT
LABELS = router_study.SETS["causal"] + router_study.SETS["leaking"]
"""The study's routers: every causal one and the two that leak (the dense row has no routing)."""
BF16_PATHS = {"bf16": "input", "bf16_fp32_router": "fp32"}
"""The bf16 decodings: name -> the routers' ``router_dtype`` in the bf16 copy of the model."""


def setting(quick: bool) -> dict:
    """The study's corpus and size (the recipe follows ``quick``), and the default places of
    the models and the results."""
    name = "routing_agreement" + ("_quick" if quick else "")
    corpus, size = ("stdlib-bytes", "quick") if quick else ("shakespeare-bpe", "baby")
    return dict(corpus=corpus, size=size, runs=ROOT / "runs" / name, json=router_study.RESULTS / f"{name}.json")


def model_path(runs: Path, label: str, seed: int) -> Path:
    return runs / f"{label}-s{seed}" / "model.pt"


# -- training -------------------------------------------------------------------------------
def train_row(label: str, seed: int, quick: bool, runs: Path, overrides: dict | None = None) -> dict:
    """Train one router with the study's row config (``overrides``: TrainConfig fields that replace
    the recipe's, such as fewer ``steps``, whose learning-rate schedule follows) and export it
    beside a summary."""
    torch.set_num_threads(1)
    from moe.training import TrainConfig, train

    s = setting(quick)
    fields = router_study.row_config(s["corpus"], s["size"], label, seed, quick) | (overrides or {})
    # resume: a row stopped after a checkpoint continues it (a fresh run refuses a folder holding checkpoints)
    fields.update(checkpoint_dir=str(model_path(runs, label, seed).parent), export_model=True, resume=True)
    res = train(TrainConfig.flat(**fields))
    ev = res.final_eval
    summary = {
        "router": label,
        "seed": seed,
        "teacher_forced_loss": ev["teacher_forced_loss"],
        "causal_loss": ev["causal_loss"],
        "train_time_s": res.train_time_s,
        "config": fields,
    }
    (model_path(runs, label, seed).parent / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def train_all(
    labels: list[str], seed: int, workers: int, quick: bool, runs: Path, overrides: dict | None = None
) -> None:
    """Train the routers whose model is not exported yet, ``workers`` processes of one thread each."""
    router_study.corpus_fields(setting(quick)["corpus"], quick)  # prepares the BPE corpus before the workers start
    todo = [label for label in labels if not model_path(runs, label, seed).is_file()]
    print(f"{len(todo)} models to train: {', '.join(todo) or 'none'}", file=sys.stderr, flush=True)
    for s in pool(train_row, [(label, seed, quick, runs, overrides) for label in todo], workers):
        print(
            f"{s['router']:<18} seed {s['seed']}  tf {s['teacher_forced_loss']:.4f}  causal {s['causal_loss']:.4f}  "
            f"{s['train_time_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def pool(fn, jobs: list[tuple], workers: int):
    """``fn(*job)`` of each job, as they finish: in this process for one worker, else in spawned ones."""
    if workers <= 1:
        yield from (fn(*job) for job in jobs)
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx) as pool:
        for fut in as_completed([pool.submit(fn, *job) for job in jobs]):
            yield fut.result()


# -- measuring ------------------------------------------------------------------------------
def measure_router(label: str, seed: int, num_windows: int, batch_size: int, quick: bool, runs: Path) -> dict:
    """Every path's routing and losses on ``num_windows`` validation windows of the study's length."""
    torch.set_num_threads(1)
    from moe.data import eval_offsets, windows
    from moe.lm import lm_loss
    from moe.training import TrainConfig, load_export

    start = time.perf_counter()
    s = setting(quick)
    fields = router_study.row_config(s["corpus"], s["size"], label, seed, quick)
    model = load_export(str(model_path(runs, label, seed)))
    corpus = TrainConfig.flat(**fields).data.load()  # the corpus the study trained and evaluated on
    seq_len = fields["seq_len"]
    idx_WT, targets_WT = windows(corpus.val, eval_offsets(corpus.val.numel(), seq_len, num_windows), seq_len)
    batches = [measure_batch(model, idx_WT[i : i + batch_size]) for i in range(0, num_windows, batch_size)]
    targets = [targets_WT[i : i + batch_size] for i in range(0, num_windows, batch_size)]
    out = {"router": label, "seed": seed, "windows": num_windows, "seq_len": seq_len, "batch_size": batch_size}
    out["decoding"] = batches[0]["how"]
    out["agreement"] = {k: merge([b["agreement"][k] for b in batches]) for k in batches[0]["agreement"]}
    out["margin"] = {k: merge_margins([b["margin"][k] for b in batches]) for k in batches[0]["margin"]}
    loss = {
        k: torch.cat([lm_loss(b["logits"][k], t, "none") for b, t in zip(batches, targets)]).double()
        for k in batches[0]["logits"]
    }
    out["loss"] = {k: v.mean().item() for k, v in loss.items()}
    out["logprob_gap"] = {}
    for name in BF16_PATHS:  # per token |log p_trainer - log p_served| of the served next token
        for trainer in ("fp32_tf", f"fp32_replay_{name}"):
            gap = (loss[trainer] - loss[f"{name}_decode"]).abs()
            out["logprob_gap"][f"{trainer}_vs_{name}_decode"] = mean_se(gap.flatten())
    out["seconds"] = time.perf_counter() - start
    return out


def measure_batch(model, idx_BT) -> dict:
    """Records, agreements and logits of one batch of windows along every path."""
    import moe
    from moe.agreement import (
        cast_parameters,
        margin_view,
        router_dtype,
        routing_agreement,
        run_decoding,
        run_forward,
        score_gaps,
    )

    tf, dec = run_forward(model, idx_BT), run_decoding(model, idx_BT)
    gaps_NL = score_gaps(model, idx_BT)  # the fp32 forward's k-th minus (k+1)-th gate logit; None without a top_k
    margin = {}
    # the trainer's forward in training mode (only ec_predictor routes otherwise there); on a copy,
    # since training forwards gather router statistics
    tf_train = run_forward(copy.deepcopy(model).train(), idx_BT)
    logits = {"fp32_tf": tf.logits, "fp32_decode": dec.logits, "fp32_tf_train": tf_train.logits}
    agreement = {
        "fp32_tf_vs_fp32_decode": compare(tf.record, dec.record),
        "fp32_tf_train_vs_fp32_decode": compare(tf_train.record, dec.record),
    }
    half = cast_parameters(model, torch.bfloat16)
    for name, dtype in BF16_PATHS.items():
        with router_dtype(half, dtype):
            served = run_decoding(half, idx_BT)
        with moe.replay_routing(model, served.record):
            replayed = run_forward(model, idx_BT)
        logits[f"{name}_decode"], logits[f"fp32_replay_{name}"] = served.logits, replayed.logits
        agreement[f"fp32_tf_vs_{name}_decode"] = compare(tf.record, served.record)
        agreement[f"fp32_tf_train_vs_{name}_decode"] = compare(tf_train.record, served.record)
        agreement[f"fp32_decode_vs_{name}_decode"] = compare(dec.record, served.record)
        if gaps_NL is not None:
            margin[f"fp32_decode_vs_{name}_decode"] = margin_view(routing_agreement(dec.record, served.record), gaps_NL)
        agreement[f"replayed_vs_{name}_decode"] = compare(replayed.record, served.record)
    return {"how": dec.how, "logits": logits, "agreement": agreement, "margin": margin}


def compare(a, b) -> tuple:
    """(the agreement of two records of a batch, each window's share of agreeing (token, layer) pairs)."""
    from moe.agreement import routing_agreement

    return routing_agreement(a, b), [
        routing_agreement(a.rows(i, i + 1), b.rows(i, i + 1)).share for i in range(a.batch_size)
    ]


def merge(parts: list[tuple]) -> dict:
    """Agreements of batches as one (the last may hold fewer windows): pair- and token-weighted
    means, and the standard error of the share over windows (each window's routing is one draw;
    pairs within it are not independent)."""
    whole = [p for p, _ in parts]
    windows = torch.tensor([share for _, shares in parts for share in shares], dtype=torch.float64)
    pairs = sum(p.pairs for p in whole)

    def weighted(values: list[float]) -> float:  # a batch's pairs, and tokens, are in proportion to its windows
        return sum(v * p.pairs for v, p in zip(values, whole)) / pairs

    return {
        "share": weighted([p.share for p in whole]),
        "share_se": (windows.std() / windows.numel() ** 0.5).item(),
        "pairs": pairs,
        "per_layer": [weighted(layer) for layer in zip(*(p.per_layer for p in whole))],
        "tokens_all_layers": weighted([p.tokens_all_layers for p in whole]),
    }


def merge_margins(parts: list[dict]) -> dict:
    """Margin views (``moe.agreement.margin_view``) of several batches as one: per layer and gap
    bin, the pairs and the flipped pairs (expert sets that differ), summed over the batches."""

    def flipped(view: dict) -> list[list[int]]:
        return [[round(n * f) for n, f in zip(ns, fs)] for ns, fs in zip(view["pairs"], view["flip_share"])]

    def add(tables: list[list[list[int]]]) -> list[list[int]]:
        return [[sum(col) for col in zip(*layer)] for layer in zip(*tables)]

    return {"edges": parts[0]["edges"], "pairs": add([p["pairs"] for p in parts]), "flipped": add(map(flipped, parts))}


def mean_se(values: torch.Tensor) -> list[float]:
    """[mean, standard error] over positions."""
    return [values.mean().item(), (values.std() / values.numel() ** 0.5).item()]


def measure_all(args: argparse.Namespace) -> dict:
    """Measure every router of ``args.routers`` and write the results JSON and its markdown."""
    labels, seed = args.routers, args.seed
    missing = [label for label in labels if not model_path(args.runs, label, seed).is_file()]
    if missing:
        raise SystemExit(f"routing_agreement: no exported model for {', '.join(missing)}: run the train command first")
    start = time.perf_counter()
    jobs = [(label, seed, args.windows, args.batch_size, args.quick, args.runs) for label in labels]
    rows = list(pool(measure_router, jobs, args.workers))
    rows.sort(key=lambda r: labels.index(r["router"]))
    for r in rows:
        r["training"] = json.loads(model_path(args.runs, r["router"], seed).with_name("summary.json").read_text())
        r["training"].pop("config", None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "date": date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "torch": torch.__version__,
        "command": "python experiments/routing_agreement.py " + " ".join(sys.argv[1:]),
        "setting": {k: str(v) for k, v in setting(args.quick).items()} | {"runs": str(args.runs)},
        "wall_time_s": time.perf_counter() - start,
        "rows": rows,
    }
    path = args.json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {path}", file=sys.stderr)
    return result


def markdown(result: dict) -> str:
    def pct(row, key, field="share"):
        a = row["agreement"][key]
        return f"{100 * a[field]:.2f}%" + (f" ± {100 * a['share_se']:.2f}" if field == "share" else "")

    def gap(row, key):
        m, se = row["logprob_gap"][key]
        return f"{m:.4f} ± {se:.4f}"

    rows = result["rows"]
    r0 = rows[0]
    lines = [
        f"Routing agreement ({r0['windows']} validation windows of {r0['seq_len']} tokens, batches of "
        f"{r0['batch_size']}; one seed per router; eval mode but for the training-mode column, where ec_predictor "
        "routes by expert choice). Agreement = share of (token, layer) pairs routed "
        "to the same expert set (± standard error over windows); (all layers) = share of tokens routed alike in every "
        "layer. fp32 TF = the fp32 "
        "teacher-forced forward; decode = one token at a time through the KV cache (expert choice: each token in the "
        "forward of its prefix); bf16 = bf16 weights with the router in bf16; bf16/fp32 router = bf16 weights, router "
        "in fp32.",
        "",
        "| router | fp32 TF vs fp32 decode | bf16 decode vs fp32 decode | bf16 decode vs fp32 TF (all layers) | "
        "bf16 decode vs fp32 TF, training mode | bf16/fp32 router decode vs fp32 decode | "
        "bf16/fp32 router decode vs fp32 TF (all layers) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['router']} | {pct(r, 'fp32_tf_vs_fp32_decode')} | {pct(r, 'fp32_decode_vs_bf16_decode')} | "
            f"{pct(r, 'fp32_tf_vs_bf16_decode')} ({pct(r, 'fp32_tf_vs_bf16_decode', 'tokens_all_layers')}) | "
            f"{pct(r, 'fp32_tf_train_vs_bf16_decode')} | "
            f"{pct(r, 'fp32_decode_vs_bf16_fp32_router_decode')} | {pct(r, 'fp32_tf_vs_bf16_fp32_router_decode')} "
            f"({pct(r, 'fp32_tf_vs_bf16_fp32_router_decode', 'tokens_all_layers')}) |"
        )
    lines += [
        "",
        "Losses in nats on the same positions. served = the causal loss of the bf16 decoding (what the engine's tokens "
        "cost); trainer = the fp32 teacher-forced forward, with its own routing or replaying the bf16 decoding's; "
        "Δ log p = mean over positions of the absolute difference between the trainer's and the served log-probability "
        "of the next token (± standard error), the mismatch an RL importance ratio sees.",
        "",
        "| router | fp32 TF | fp32 causal | bf16 served | trainer replaying bf16 | Δ log p, no replay | "
        "Δ log p, replay | bf16/fp32 router served | Δ log p, no replay | Δ log p, replay |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        loss = r["loss"]
        lines.append(
            f"| {r['router']} | {loss['fp32_tf']:.4f} | {loss['fp32_decode']:.4f} | {loss['bf16_decode']:.4f} | "
            f"{loss['fp32_replay_bf16']:.4f} | {gap(r, 'fp32_tf_vs_bf16_decode')} | "
            f"{gap(r, 'fp32_replay_bf16_vs_bf16_decode')} | {loss['bf16_fp32_router_decode']:.4f} | "
            f"{gap(r, 'fp32_tf_vs_bf16_fp32_router_decode')} | {gap(r, 'fp32_replay_bf16_fp32_router_vs_bf16_fp32_router_decode')} |"
        )
    return "\n".join(lines + margin_lines(rows)) + "\n"


MARGIN_PATHS = {"bf16_decode": "bf16 weights, bf16 router", "bf16_fp32_router_decode": "bf16 weights, fp32 router"}
"""The margin tables: the decoding compared with fp32 decoding -> its words."""


def bin_label(low: float, high: float) -> str:
    return f"≥ {low:g}" if high == float("inf") else f"[{low:g}, {high:g})"


def margin_lines(rows: list[dict]) -> list[str]:
    """Per decoding of :data:`MARGIN_PATHS`, router with a ``top_k`` and layer: how the pairs
    that flipped against fp32 decoding spread over the gap between the fp32 forward's k-th and
    (k+1)-th gate logit: each bin's share of the layer's flips (flipped / pairs in the bin)."""
    ranked = [r for r in rows if r.get("margin")]
    if not ranked:
        return []
    edges = next(iter(ranked[0]["margin"].values()))["edges"]
    bins = [bin_label(lo, hi) for lo, hi in zip(edges, edges[1:])]
    lines = []
    for path, words in MARGIN_PATHS.items():
        lines += [
            "",
            f"Margin view, {words} decoding vs fp32 decoding: per layer, each bin of the gap between the k-th and "
            "(k+1)-th gate logit of the fp32 forward holds this share of the layer's flipped (token, layer) pairs "
            "(flipped / pairs in the bin). Routers without a top_k (thresholds, top-p, ReLU, expert choice) have no "
            "k-th score.",
            "",
            "| router | layer | " + " | ".join(bins) + " | flips |",
            "|---|---:|" + "---:|" * (len(bins) + 1),
        ]
        for r in ranked:
            view = r["margin"][f"fp32_decode_vs_{path}"]
            for layer, (pairs, flipped) in enumerate(zip(view["pairs"], view["flipped"])):
                total = sum(flipped)
                cells = [f"{100 * f / max(total, 1):.0f}% ({f}/{n})" for f, n in zip(flipped, pairs)]
                lines.append(f"| {r['router']} | {layer} | " + " | ".join(cells) + f" | {total} |")
    return lines


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the test's run: stdlib bytes, the quick size and recipe")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train and export one model per router (the study's row config)")
    m = sub.add_parser("measure", help="the agreement and loss figures of the exported models")
    for s in (t, m):
        s.add_argument("--routers", nargs="+", default=LABELS, choices=LABELS)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--workers", type=int, default=2, help="processes, one thread each (1: in this process)")
        s.add_argument("--runs", type=Path, help="the models' folder (default: runs/routing_agreement[_quick])")
    m.add_argument("--windows", type=int, default=128, help="validation windows (the study evaluates 128)")
    m.add_argument("--batch-size", type=int, default=64, help="windows decoded together (the study's 64)")
    m.add_argument("--json", type=Path, help="results (default: experiments/results/routing_agreement[_quick].json)")
    args = p.parse_args(argv)
    args.runs = args.runs or setting(args.quick)["runs"]
    if args.command == "train":
        train_all(args.routers, args.seed, args.workers, args.quick, args.runs)
        return None
    args.json = args.json or setting(args.quick)["json"]
    return measure_all(args)


if __name__ == "__main__":
    main()
