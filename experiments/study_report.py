"""The router study's table, figures and registered verdict, drawn from the results JSON alone
(``python experiments/router_study.py --replot JSON``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from study_stats import ALPHA, pool_sweep, registered_rows, summarise, t_halfwidth

from moe.eval import format_difference
from moe.extras import pyplot

SMOKE = (
    "SMOKE TEST (--quick): a tiny model trained for a few steps on a few seeds, to check that the study runs; "
    "its losses and ranking mean nothing about the routers."
)


def pm(value: float, se: float, digits: int = 4, sign: bool = False) -> str:
    """``value ± se``, or the value alone where one seed gives no standard error (NaN)."""
    v = format_difference(value, digits, plus=sign)
    return v if math.isnan(se) else f"{v} ± {se:.{digits}f}"


def cell(s: dict, k: str, digits: int = 4) -> str:
    """The mean of ``k`` over a summary entry's seeds, with its standard error."""
    return pm(s[k], s[k + "_se"], digits)


def versus(s: dict) -> str:
    """The paired comparison of one summary entry, in words and numbers."""
    if "paired_diff" not in s:
        return ""
    t, p, n = s["paired_t"], s["paired_p"], s["paired_n"]
    head = f"{pm(s['paired_diff'], s['paired_diff_se'], sign=True)} vs {s['baseline']}"
    if math.isnan(t):
        return f"{head} ({n} seed{'s' * (n > 1)}, no test)"
    return f"{head} (95% ±{s['paired_ci95']:.4f}; t {t:+.1f}, p {p:.2g}, Holm p {s['paired_p_holm']:.2g}; {n} seeds)"


def verdict_words(s: dict) -> str:
    return s.get("verdict", "") if "paired_diff" in s and not math.isnan(s["paired_t"]) else ""


def panel_caption(sub: list[dict]) -> str:
    """One line: which challengers of a panel are better or worse than its baseline (Holm)."""
    tested = [s for s in sub if verdict_words(s)]
    if not tested:
        return "no paired test"
    better = [s["router"] for s in tested if s["verdict"] == "better"]
    worse = [s["router"] for s in tested if s["verdict"] == "worse"]
    base = " / ".join(sorted({s["baseline"] for s in tested}))
    return (
        f"vs {base}, causal loss, Holm over {len(tested)} tests at {ALPHA}: better {', '.join(better) or 'none'}; "
        f"worse {', '.join(worse) or 'none'}; the other {len(tested) - len(better) - len(worse)} not distinguished"
    )


def split_registered(result: dict, registrations: dict[str, dict] | None) -> tuple[dict, list[dict]]:
    """The result without the rows of any registered test (``registrations``: name -> registration),
    and those rows. They never join the exploratory tables and figures: before the verdict so that
    nobody takes an interim look at a test fixed in advance, after it so that each table keeps one
    seed set per panel and one family of tests (each registered test gets a table and a figure of
    its own)."""
    mine = [r for reg in (registrations or {}).values() for r in registered_rows(reg, result["rows"])]
    held = {id(r) for r in mine}
    return {**result, "rows": [r for r in result["rows"] if id(r) not in held]}, [
        r for r in result["rows"] if id(r) in held
    ]


TABLE_HEAD = [
    "| corpus | size | router | seeds | active params | teacher-forced | causal | decoded together | gap | "
    "MaxVio | dead | experts/token | tokens/s | vs best top-k (causal) | verdict |",
    "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
]


def summary_line(s: dict) -> str:
    """One router of one panel as a row of the main table."""
    return (
        f"| {s['corpus']} | {s['size']} | {s['router']} | {len(s['seeds'])} | {s['active_params']:,} | "
        f"{cell(s, 'teacher_forced_loss')} | {cell(s, 'causal_loss')} | {'/'.join(map(str, s['causal_eval_batch']))} | "
        f"{cell(s, 'leakage_gap')} | {cell(s, 'max_vio', 3)} | {s['dead_experts']} | {cell(s, 'active_experts_mean', 2)} | "
        f"{s['tokens_per_s']:,.0f} | {versus(s)} | {verdict_words(s)} |"
    )


def held_words(registered: list[dict], registrations: dict[str, dict] | None) -> str:
    """What the table's head says of the registered rows it leaves out."""
    if not registered:
        return ""
    if any(reg.get("verdict") is None for reg in registrations.values()):
        return f", {len(registered)} registered rows held out"
    return f"; the registered tests' {len(registered)} rows in their own tables below"


def markdown(result: dict, registrations: dict[str, dict] | None = None) -> str:
    head = [SMOKE, ""] if result.get("quick") else []
    rows = result["rows"]
    result, registered = split_registered(result, registrations)
    lines = head + [
        f"Router study ({len(result['rows'])} rows{held_words(registered, registrations)}, "
        f"{result['wall_time_s'] / 60:.0f} min of runs). Losses in nats on "
        "the same validation positions, mean ± standard error over seeds; causal = what decoding computes (KV cache, "
        "or each prefix recomputed), with 'decoded together' sequences routed in one batch (1: a sequence decoded "
        "alone; it matters only for routers that are not batch-invariant); gap = causal - teacher-forced; MaxVio = "
        "global (the validation set, eval mode); experts/token measured in eval. vs best top-k = causal-loss "
        "difference from the better (by mean causal loss) dropless top-k baseline, paired by seed, with its 95% "
        f"t interval, the paired t-test (seeds - 1 degrees of freedom) and its p Holm-adjusted over the panel's "
        f"tests; verdict at a family-wise {ALPHA}. The pool sweep's arms are in the second table.",
        "",
        *TABLE_HEAD,
    ]

    summary = summarise(result["rows"])
    lines += [summary_line(s) for s in summary]
    lines += ["", "Verdicts per panel:", ""]
    for panel in sorted({(s["corpus"], s["size"]) for s in summary}):
        sub = [s for s in summary if (s["corpus"], s["size"]) == panel]
        lines.append(f"- {panel[0]}, {panel[1]}: {panel_caption(sub)}")
    sweep = pool_sweep(result["rows"])
    if sweep:
        lines += [
            "",
            "Expert choice's selection pool in training: each expert ranks the tokens of a sequence or of the whole "
            "batch; the 4x larger batch takes a quarter of the steps (equal tokens, so both of its arms are "
            "under-trained against the 2,000-step rows). Its causal loss is measured with 'decoded together' "
            "sequences in one batch; a batch-pooled router decoded alone routes each prefix among its own tokens. vs "
            "top-k = difference from the better dropless top-k baseline trained with the same batch, paired by seed, "
            "Holm over the panel's pools.",
            "",
            "| corpus | size | router | batch | pool (tokens) | seeds | teacher-forced | causal | decoded together | "
            "gap | vs top-k, teacher-forced | vs top-k, causal | verdict |",
            "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for s in sweep:
            tf = f"{pm(s['paired_diff_tf'], s['paired_diff_tf_se'], sign=True)}" if "paired_diff" in s else "no control"
            lines.append(
                f"| {s['corpus']} | {s['size']} | {s['router']} | {s['batch_size']} | {s['pool']:,} | "
                f"{len(s['seeds'])} | {cell(s, 'teacher_forced_loss')} | {cell(s, 'causal_loss')} | "
                f"{'/'.join(map(str, s['causal_eval_batch']))} | {cell(s, 'leakage_gap')} | {tf} | {versus(s)} | "
                f"{verdict_words(s)} |"
            )
    for registration in (registrations or {}).values():
        mine = registered_rows(registration, rows)
        lines += ["", *registration_lines(registration, len(mine))]
        if registration.get("verdict") is not None:
            lines += ["", "Its rows (the baseline column is the registered test's numbers):", "", *TABLE_HEAD]
            lines += [summary_line(s) for s in summarise(mine, registration["baseline"])]
    return "\n".join(lines) + "\n"


def registration_lines(registration: dict, held: int = 0) -> list[str]:
    """The registered test and, once every registered row is stored, its verdict."""
    seeds = registration["seeds"]
    lines = [
        f"Registered test (committed before its rows ran): {', '.join(registration['challengers'])} against "
        f"{registration['baseline']}, {registration['corpus']}, {registration['size']} size, seeds {seeds[0]}-"
        f"{seeds[-1]} ({len(seeds)}), {registration['test']}, alpha {registration['alpha']}.",
    ]
    verdict = registration.get("verdict")
    if verdict is None:
        total = len(registration["seeds"]) * (1 + len(registration["challengers"]))
        return lines + [
            "",
            f"Verdict: not yet: {held} of its {total} rows are stored, held out of the tables and figures above "
            "until every row is and the verdict is recorded (no interim look).",
        ]
    lines += ["", "| challenger | causal diff | 95% t interval | t | p | Holm p | ahead on | decision |"]
    lines.append("|---|---:|---:|---:|---:|---:|---|---|")
    for c in verdict["challengers"]:
        lines.append(
            f"| {c['challenger']} | {pm(c['diff'], c['se'], sign=True)} | ±{c['ci95']:.4f} | {c['t']:+.2f} | "
            f"{c['p']:.3g} | {c['p_holm']:.3g} | {c['ahead_on']} | {c['decision']} |"
        )
    return lines


def plot(result: dict, path: Path) -> None:
    """Per corpus x size panel that holds a paired comparison: the losses, each challenger minus
    the better top-k paired by seed, the experts each token used; 95% t intervals; the
    verdicts as the caption."""
    plt = pyplot("the study's figures")

    summary = summarise(result["rows"])
    panels = sorted({(s["corpus"], s["size"]) for s in summary if "paired_diff" in s})
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 3, figsize=(19, 4.4 * len(panels) + 0.6), squeeze=False)
    captions = []
    for i, panel in enumerate(panels):
        sub = sorted((s for s in summary if (s["corpus"], s["size"]) == panel), key=lambda s: s["causal_loss"])
        plot_losses(axes[i][0], sub, panel)
        plot_paired(axes[i][1], [s for s in sub if "paired_diff" in s])
        plot_experts(axes[i][2], sub, result["rows"], panel)
        captions.append(f"{panel[0]}, {panel[1]}: {panel_caption(sub)}")
    if result.get("quick"):
        captions.insert(0, SMOKE)
    fig.tight_layout(rect=(0, 0.025 * len(captions) / len(panels), 1, 1))
    fig.text(0.01, 0.005, "\n".join(captions), fontsize=8, va="bottom", ha="left", wrap=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _interval(s: dict, k: str) -> float:
    """95% t half-width of the mean of ``k`` over the seeds of ``s`` (0 where undefined)."""
    h = t_halfwidth(s[k + "_se"], len(s["seeds"]))
    return 0.0 if math.isnan(h) else h


def plot_losses(ax, sub: list[dict], panel: tuple[str, str]) -> None:
    x = list(range(len(sub)))
    for k, label, color, shift in (
        ("teacher_forced_loss", "teacher-forced", "tab:gray", -0.2),
        ("causal_loss", "causal (decoded)", "tab:blue", 0.2),
    ):
        err = [_interval(s, k) for s in sub]
        ax.bar([v + shift for v in x], [s[k] for s in sub], 0.4, label=label, yerr=err, color=color)
    lo = min(min(s["teacher_forced_loss"], s["causal_loss"]) for s in sub)
    hi = max(max(s["teacher_forced_loss"], s["causal_loss"]) for s in sub)
    ax.set_ylim(lo - 0.02, hi + 0.02)
    ax.set_xticks(x, [s["router"] for s in sub], rotation=30, ha="right", fontsize=8)
    ax.set(title=f"{panel[0]}, {panel[1]}: validation loss (95% t interval over seeds)", ylabel="nats")
    ax.legend(fontsize=8)


def plot_paired(ax, sub: list[dict]) -> None:
    """Each challenger minus the better top-k, paired by seed: causal (what decoding gets) and
    teacher-forced; a leak shows as the distance between the two."""
    y = list(range(len(sub)))
    for k, ci, label, color, shift in (
        ("paired_diff_tf", "paired_ci95_tf", "teacher-forced", "tab:gray", 0.15),
        ("paired_diff", "paired_ci95", "causal (decoded)", "tab:blue", -0.15),
    ):
        err = [0 if math.isnan(s[ci]) else s[ci] for s in sub]
        ax.errorbar([s[k] for s in sub], [v + shift for v in y], xerr=err, fmt="o", capsize=3, color=color, label=label)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(y, [f"{s['router']} (n {s['paired_n']}) {verdict_words(s)}" for s in sub], fontsize=8)
    ax.invert_yaxis()
    baselines = " / ".join(sorted({s["baseline"] for s in sub}))
    ax.set(
        title=f"minus {baselines}, paired by seed (95% t interval per comparison; verdicts Holm-adjusted)",
        xlabel="loss difference, nats (< 0: better)",
    )
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


def plot_registered(registration: dict, rows: list[dict], path: Path) -> None:
    """The registered test: each challenger's causal loss minus the baseline's, one dot per
    registered seed, with the mean, its 95% t interval and the recorded verdict."""
    plt = pyplot("the study's figures")

    by = {(r["router"], r["seed"]): r["causal_loss"] for r in rows}
    verdicts = registration["verdict"]["challengers"]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 1.1 * len(verdicts)))
    for y, c in enumerate(verdicts):
        diffs = [by[c["challenger"], s] - by[registration["baseline"], s] for s in registration["seeds"]]
        ax.scatter(diffs, [y + 0.18] * len(diffs), s=14, color="tab:gray", label="one seed" if y == 0 else None)
        ax.errorbar(
            c["diff"], y, xerr=c["ci95"], fmt="o", capsize=4, color="tab:blue", label="mean, 95% t" if y == 0 else None
        )
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(
        range(len(verdicts)),
        [f"{c['challenger']}: {c['decision']} (Holm p {c['p_holm']:.2g})" for c in verdicts],
        fontsize=8,
    )
    ax.set_ylim(len(verdicts) - 0.4, -0.6)
    ax.set_title(  # two lines: beside the verdicts' long tick labels one line runs off the figure
        f"registered test: causal loss minus {registration['baseline']}'s\n"
        f"{registration['corpus']}, {registration['size']} size, {len(registration['seeds'])} seeds",
        fontsize=10,
    )
    ax.set_xlabel("causal loss difference, nats (< 0: better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pool_panels(sweep: list[dict]) -> list[tuple[str, str]]:
    """The corpus x size panels of the sweep that hold more than one pool size."""
    pools: dict[tuple[str, str], set[int]] = {}
    for s in sweep:
        pools.setdefault((s["corpus"], s["size"]), set()).add(s["pool"])
    return sorted(panel for panel, sizes in pools.items() if len(sizes) > 1)


def plot_pool(sweep: list[dict], path: Path) -> None:
    """Expert choice's losses against its training pool, each minus the better top-k at the same batch."""
    plt = pyplot("the study's figures")

    panels = pool_panels(sweep)
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        sub = sorted(
            (s for s in sweep if (s["corpus"], s["size"]) == panel and "paired_diff" in s), key=lambda s: s["pool"]
        )
        for k, ci, label, color in (
            ("paired_diff_tf", "paired_ci95_tf", "teacher-forced", "tab:gray"),
            ("paired_diff", "paired_ci95", "causal (decoded)", "tab:blue"),
        ):
            ax.errorbar(
                [s["pool"] for s in sub],
                [s[k] for s in sub],
                yerr=[0 if math.isnan(s[ci]) else s[ci] for s in sub],
                marker="o",
                capsize=3,
                label=label,
                color=color,
            )
        for s in sub:
            decoded = "/".join(map(str, s["causal_eval_batch"]))
            ax.annotate(f"batch {s['batch_size']}, decoded {decoded}", (s["pool"], s["paired_diff"]), fontsize=7)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(
            title=f"{panel[0]}, {panel[1]}: expert choice - best top-k, same batch",
            xlabel="selection pool in training (tokens)",
            ylabel="loss difference, nats (95% t interval, paired)",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict, json_path: Path, registrations: dict[str, dict] | None = None) -> str:
    """Write the JSON (atomically), the markdown table and the figures beside it; the table."""
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(json_path)
    table = markdown(result, registrations)
    json_path.with_suffix(".md").write_text(table)
    rows = result["rows"]
    result, _ = split_registered(result, registrations)
    if result["rows"]:
        plot(result, json_path.with_suffix(".png"))
    for name, registration in (registrations or {}).items():
        if registration.get("verdict") is not None:
            figure = json_path.with_name(f"{json_path.stem}_registered{name}.png")
            plot_registered(registration, registered_rows(registration, rows), figure)
    sweep = [s for s in pool_sweep(result["rows"]) if "paired_diff" in s]
    if pool_panels(sweep):
        plot_pool(sweep, json_path.with_name(json_path.stem + "_pool.png"))
    return table
