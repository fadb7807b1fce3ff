"""The packet-loss study's results (``experiments/packet_loss.py``): each configuration's
summary over its seeds (the perplexity change paired by seed with the reliable run), the markdown
table, the figure and the files written next to ``--json``."""

from __future__ import annotations

import json
import math
from datetime import date
from pathlib import Path

import numpy as np

from moe.extras import pyplot
from moe.parallel.lossy import METRICS, POLICIES

PAPER_PCT = 0.8
""""Distributed Training under Packet Loss": at most 0.8% perplexity change at 10% loss (LLaMA-2 7B, 64 GPUs)."""
HISTORY = ("loss", *METRICS)
"""The per-step figures a run records."""


def run_key(run: dict) -> tuple:
    """A run's identity in a study's .raw.json: its batch, workers, loss rate, policy and seed."""
    return run["batch_size"], run["workers"], run["loss_rate"], run["policy"], run["seed"]


def compact(res: dict) -> dict:
    """A run's record with its per-step figures rounded to 5 significant digits (for the .raw.json)."""
    return {**res, "history": {k: [float(f"{v:.5g}") for v in vs] for k, vs in res["history"].items()}}


def summarise(raw: list[dict]) -> list[dict]:
    """One record per (tokens per step, workers, loss rate, policy) over its seeds; perplexity
    change paired by seed with the reliable run of the same size and workers."""
    base = {(r["batch_size"], r["workers"], r["seed"]): r["val_loss"] for r in raw if r["policy"] == "reliable"}
    base_curve = {
        (r["batch_size"], r["workers"], r["seed"]): r["curve"]
        for r in raw
        if r["policy"] == "reliable" and "curve" in r
    }
    keys = sorted(
        dict.fromkeys((r["batch_size"], r["workers"], r["loss_rate"], r["policy"]) for r in raw),
        key=lambda k: (k[0], k[1], k[2], POLICIES.index(k[3])),
    )
    runs = []
    for batch, workers, rate, policy in keys:
        rs = sorted(
            (
                r
                for r in raw
                if (r["batch_size"], r["workers"], r["loss_rate"], r["policy"]) == (batch, workers, rate, policy)
            ),
            key=lambda r: r["seed"],
        )
        paired = [r for r in rs if (batch, workers, r["seed"]) in base]
        change = [100 * (math.exp(r["val_loss"] - base[batch, workers, r["seed"]]) - 1) for r in paired]
        # figures a study before them did not record (the predicted error, the noise share) are None
        per_seed = {k: np.asarray([np.mean(r["history"][k]) for r in rs]) for k in HISTORY if k in rs[0]["history"]}
        val_loss = float(np.mean([r["val_loss"] for r in rs]))
        runs.append(
            {
                "workers": workers,
                "batch_size": batch,
                "tokens_per_step": rs[0]["tokens_per_step"],
                "sequences_per_worker": batch // workers,
                "loss_rate": rate,
                "policy": policy,
                "seeds": [r["seed"] for r in rs],
                "val_loss": val_loss,
                "val_ppl": math.exp(val_loss),
                "val_loss_per_seed": [r["val_loss"] for r in rs],
                "ppl_change_pct": float(np.mean(change)) if change else None,
                "ppl_change_se": _se(change),
                "ppl_change_per_seed": change,
                **{k: float(per_seed[k].mean()) if k in per_seed else None for k in METRICS},
                **{
                    f"{k}_se": _se(per_seed[k].tolist()) if k in per_seed else None
                    for k in ("grad_rel_error", "grad_rel_error_predicted", "grad_noise_share", "grad_bias")
                },
                **_noise_share(per_seed.get("grad_noise_share"), workers),
                **_curve_summary(rs, base_curve, (batch, workers)),
                "val_ppl_sd_pct": _sd_pct([math.exp(r["val_loss"]) for r in rs]),
                "max_drift": float(max(max(r["history"]["max_drift"]) for r in rs)),
                "rms_drift_mean": float(per_seed["rms_drift"].mean()),
                "wall_s": float(sum(r["wall_s"] for r in rs)),
            }
        )
    return runs


def _noise_share(per_seed: np.ndarray | None, workers: int) -> dict:
    """The noise share Var(mean) / |mean|^2 over the seeds (mean, SE): the step's
    ``grad_noise_share`` is (P - 1) / P of it in expectation (``moe.parallel.lossy``)."""
    if per_seed is None:
        return {"noise_share": None, "noise_share_se": None}
    share = per_seed * workers / (workers - 1)
    return {"noise_share": float(share.mean()), "noise_share_se": _se(share.tolist())}


def _curve_summary(rs: list[dict], base_curve: dict, size: tuple[int, int]) -> dict:
    """With ``--eval-every``: per validation point, the perplexity change against the reliable
    run of the same seed (mean ± SE over the paired seeds) and the replicas' drift (the largest
    over the seeds of the largest since the point before)."""
    paired = [r for r in rs if "curve" in r and (*size, r["seed"]) in base_curve]
    if not paired:
        return {}
    points = []
    for i, point in enumerate(paired[0]["curve"]):
        change = [
            100 * (math.exp(r["curve"][i]["val_loss"] - base_curve[(*size, r["seed"])][i]["val_loss"]) - 1)
            for r in paired
        ]
        points.append(
            {
                "step": point["step"],
                "val_loss": float(np.mean([r["curve"][i]["val_loss"] for r in paired])),
                "ppl_change_pct": float(np.mean(change)),
                "ppl_change_se": _se(change),
                "max_drift": max(r["curve"][i]["max_drift"] for r in paired),
                "max_drift_last": float(np.mean([r["curve"][i]["max_drift_last"] for r in paired])),
            }
        )
    return {"curve": points}


def _se(values: list[float]) -> float | None:
    """Standard error of the mean (None below two values)."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None


def _sd_pct(values: list[float]) -> float | None:
    """Standard deviation over seeds in percent of the mean: how far apart runs that differ only
    in their seed land (None below two values)."""
    return float(100 * np.std(values, ddof=1) / np.mean(values)) if len(values) > 1 else None


def _pm(value: float | None, se: float | None, fmt: str) -> str:
    if value is None:
        return ""
    return format(value, fmt) + ("" if se is None else f" ± {format(se, fmt.lstrip('+'))}")


def table(runs: list[dict]) -> str:
    lines = [
        "| tokens/step | workers | seq/worker | loss rate | policy | seeds | val ppl | seed sd % | ppl change % "
        "| grad rel error | predicted | noise share | grad bias | received | max drift |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['tokens_per_step']} | {r['workers']} | {r['sequences_per_worker']} | {r['loss_rate']:.2f} | {r['policy']} "
            f"| {len(r['seeds'])} | {r['val_ppl']:.3f} | {_pm(r['val_ppl_sd_pct'], None, '.2f')} "
            f"| {_pm(r['ppl_change_pct'], r['ppl_change_se'], '+.2f')} "
            f"| {_pm(r['grad_rel_error'], r['grad_rel_error_se'], '.4f')} "
            f"| {_pm(r['grad_rel_error_predicted'], r['grad_rel_error_predicted_se'], '.4f')} "
            f"| {_pm(r['noise_share'], r['noise_share_se'], '.3f')} | {_pm(r['grad_bias'], r['grad_bias_se'], '+.4f')} "
            f"| {r['received_fraction']:.3f} | {r['max_drift']:.2e} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, pretrained: dict[str, list[dict]] | None = None) -> None:
    """The study's figure, by the axis it varies: validation curves (``--eval-every``), a
    pretrained start, the split of a fixed number of tokens per step among workers, or the
    tokens per step."""
    plt = pyplot("the packet-loss figure")

    lossy = [r for r in runs if r["policy"] != "reliable" and r["ppl_change_pct"] is not None]
    workers_at = {}
    for r in runs:
        workers_at.setdefault(r["tokens_per_step"], set()).add(r["workers"])
    split = [t for t, ws in workers_at.items() if len(ws) > 1]
    if any("curve" in r for r in lossy):
        fig = _plot_curves(plt, lossy)
    elif pretrained:
        fig = _plot_pretrained(plt, lossy, pretrained)
    elif split:
        fig = _plot_split(plt, [r for r in runs if r["tokens_per_step"] == max(split)])
    elif len({(r["tokens_per_step"], r["workers"]) for r in lossy}) == 1:
        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        _bars(ax, lossy)
    else:
        fig = _plot_sizes(plt, lossy)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _paper_line(ax) -> None:
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axhline(PAPER_PCT, color="red", lw=0.9, ls="--", label="paper: 0.8% at 10% (LLaMA-2 7B, 64 GPUs)")


def _plot_curves(plt, lossy: list[dict]):
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.4))
    for r in lossy:
        label = f"{r['policy']} p={r['loss_rate']:g}, P={r['workers']} x {r['sequences_per_worker']}"
        steps = [c["step"] for c in r["curve"]]
        change = np.asarray([c["ppl_change_pct"] for c in r["curve"]])
        se = np.asarray([c["ppl_change_se"] or 0.0 for c in r["curve"]])
        (line,) = ax0.plot(steps, change, marker="o", ms=3, label=label)
        ax0.fill_between(steps, change - se, change + se, color=line.get_color(), alpha=0.2)
        ax1.plot(steps, [c["max_drift"] for c in r["curve"]], marker="o", ms=3, color=line.get_color(), label=label)
        ax1.plot(steps, [c["max_drift_last"] for c in r["curve"]], ls=":", color=line.get_color())
    _paper_line(ax0)
    ax0.set(xlabel="step", ylabel="val perplexity change vs reliable (%)", title="the cost along training (mean ± SE)")
    ax1.set(
        xlabel="step",
        ylabel="max |replica spread| of an element",
        yscale="log",
        title="drift: largest since the point before (solid), at the point (dotted)",
    )
    for ax in (ax0, ax1):
        ax.legend(fontsize=7)
    return fig


def _plot_pretrained(plt, lossy: list[dict], pretrained: dict[str, list[dict]]):
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.4))
    for batch, curve in pretrained.items():
        ax0.plot([c["step"] for c in curve], [c["val_loss"] for c in curve], marker="o", ms=3, label=f"batch {batch}")
    ax0.set(xlabel="pretraining step", ylabel="val loss (nats)", title="the reliable pretraining the runs start from")
    ax0.legend(fontsize=7)
    _bars(ax1, lossy)
    ax1.set_title("from the pretrained start (mean ± SE, seeds as dots)")
    return fig


def _bars(ax, lossy: list[dict]) -> None:
    """The perplexity change of each lossy configuration of one point: mean ± SE, seeds as dots."""
    names = [f"{r['policy']} p={r['loss_rate']:g}\nP={r['workers']} x {r['sequences_per_worker']}" for r in lossy]
    x = np.arange(len(lossy))
    ax.bar(x, [r["ppl_change_pct"] for r in lossy], yerr=[r["ppl_change_se"] or 0.0 for r in lossy], capsize=4)
    for i, r in enumerate(lossy):
        ax.plot([i] * len(r["ppl_change_per_seed"]), r["ppl_change_per_seed"], "k.", ms=4)
    _paper_line(ax)
    ax.set_xticks(x, names, fontsize=8)
    ax.set(ylabel="val perplexity change vs reliable (%)", title="the cost at this point (mean ± SE, seeds as dots)")
    ax.legend(fontsize=7)


def _errorbar(ax, x: list, rs: list[dict], key: str, se_key: str | None = None, **kwargs):
    """``key`` of each summary in ``rs`` against ``x``, with its standard error (``key_se``) as the bar."""
    se_key = se_key or f"{key}_se"
    return ax.errorbar(x, [r[key] for r in rs], yerr=[r[se_key] or 0.0 for r in rs], marker="o", capsize=3, **kwargs)


def _plot_split(plt, runs: list[dict]):
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.4))
    workers = sorted({r["workers"] for r in runs})
    ticks = [f"{w} x {runs[0]['batch_size'] // w}" for w in workers]
    lossy = [r for r in runs if r["policy"] != "reliable" and r["ppl_change_pct"] is not None]
    for rate, policy in dict.fromkeys((r["loss_rate"], r["policy"]) for r in lossy):
        rs = sorted((r for r in lossy if (r["loss_rate"], r["policy"]) == (rate, policy)), key=lambda r: r["workers"])
        ws, label = [r["workers"] for r in rs], f"{policy} p={rate:g}"
        line = _errorbar(ax0, ws, rs, "ppl_change_pct", "ppl_change_se", label=label)
        color = line.lines[0].get_color()
        _errorbar(ax1, ws, rs, "grad_rel_error", color=color, label=f"{label}, measured")
        pred = [(w, r["grad_rel_error_predicted"]) for w, r in zip(ws, rs) if r["grad_rel_error_predicted"] is not None]
        if pred:
            ax1.plot(*zip(*pred), "x", ms=9, color=color, label=f"{label}, predicted from the noise share")
    shares = [(r["workers"], r["noise_share"]) for r in runs if r["noise_share"] is not None]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        pts = sorted(
            (r["workers"], r["noise_share"]) for r in runs if r["policy"] == policy and r["noise_share"] is not None
        )
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=policy)
    _paper_line(ax0)
    ax0.set(
        ylabel="val perplexity change vs reliable (%)",
        title=f"{runs[0]['tokens_per_step']:,} tokens per step, split (mean ± SE)",
    )
    ax1.set(ylabel="||estimate - mean|| / ||mean||", title="aggregated gradient's error per step")
    ax2.set(
        ylabel="Var(mean) / |mean|^2, from the workers' spread",
        title="noise share of the mean gradient" + ("" if shares else " (not recorded)"),
    )
    for ax in (ax0, ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(workers, ticks)
        ax.minorticks_off()
        ax.set_xlabel("workers x sequences per worker")
        ax.legend(fontsize=7)
    return fig


def _plot_sizes(plt, lossy: list[dict]):
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.4))
    for n, (rate, policy) in enumerate(dict.fromkeys((r["loss_rate"], r["policy"]) for r in lossy)):
        rs = sorted(
            (r for r in lossy if (r["loss_rate"], r["policy"]) == (rate, policy)), key=lambda r: r["tokens_per_step"]
        )
        label, tokens = f"{policy} p={rate:g}", [r["tokens_per_step"] for r in rs]
        _errorbar(ax0, tokens, rs, "ppl_change_pct", "ppl_change_se", label=label)
        for ax, key in ((ax1, "grad_rel_error"), (ax2, "grad_bias")):
            _errorbar(ax, tokens, rs, key, label=label)
        if policy == "naive":
            ax2.plot(
                tokens,
                [-rate * (r["workers"] - 1) / r["workers"] for r in rs],
                "x",
                color="grey",
                label=f"naive predicted -p(P-1)/P, p={rate:g}",
            )
        if policy == "unbiased":
            ax1.axhline(
                math.sqrt(rate / (1 - rate)),
                color="grey",
                ls=":",
                label=f"unbiased, all noise: sqrt(p/(1-p)), p={rate:g}",
            )
        if n == 0:
            for r in rs:
                ax0.annotate(
                    f"P={r['workers']}, {len(r['seeds'])} seeds",
                    (r["tokens_per_step"], r["ppl_change_pct"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(5, 8),
                )
    _paper_line(ax0)
    ax0.set(
        ylabel="val perplexity change vs reliable (%)",
        title="cost of packet loss at equal steps (mean ± SE, paired seeds)",
    )
    ax1.set(ylabel="||estimate - mean|| / ||mean||", title="aggregated gradient's error per step (± SE over seeds)")
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.set(ylabel="<estimate - mean, mean> / ||mean||²", title="aggregated gradient's bias per step")
    sizes = sorted({r["tokens_per_step"] for r in lossy})
    for ax in (ax0, ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{t:,}" for t in sizes])
        ax.minorticks_off()
        ax.set_xlabel("tokens per step")
        ax.legend(fontsize=7)
    return fig


def write(
    json_path: Path,
    common: dict,
    commands: list[str],
    raw: list[dict],
    wall: float,
    final: bool,
    pretrained: dict[str, list[dict]] | None = None,
) -> list[dict]:
    """Write the per-run records (.raw.json), the summary (json, md) and, at the end, the figure.
    ``pretrained``: the pretraining's validation curve per global batch (with ``--pretrain``)."""
    runs = summarise(raw)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    extra = {"pretrained_curves": pretrained} if pretrained else {}
    result = {
        "date": date.today().isoformat(),
        "wall_s": wall,
        "complete": final,
        "config": common,
        "commands": commands,
        **extra,
        "runs": runs,
    }
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".raw.json").write_text(
        json.dumps({"config": common, "commands": commands, "wall_s": wall, **extra, "runs": raw}) + "\n"
    )
    json_path.with_suffix(".md").write_text(table(runs) + "\n")
    if final or len(raw) % 6 == 0:
        plot(runs, json_path.with_suffix(".png"), pretrained)
    return runs
