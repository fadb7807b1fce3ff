"""The router study's statistics, from stored rows alone: means and standard errors over seeds,
differences paired by seed, paired t-tests, the Holm correction over each table's challengers,
t-based confidence intervals, the pool sweep, and the verdict of a registered test.

One baseline rule everywhere: a challenger is paired, seed by seed, with the better (by mean
causal loss) of the dropless top-k baselines trained with the same batch in the same corpus x
size panel. One standard of evidence: a difference is called a difference only where the
paired t-test's p-value, Holm-adjusted over every challenger of its table (corpus x size
panel, or the pool sweep's panel), is below ``ALPHA``; otherwise the two are not
distinguished at that many seeds.
"""

from __future__ import annotations

import math
import statistics


class StudyError(ValueError):
    """A study that cannot run as asked (printed in one line, exit 2)."""


ALPHA = 0.05
"""The family-wise level of every table's tests (Holm)."""
BASELINES = ("topk_aux", "topk_lossfree", "topk_aux_b48")
"""The dropless top-k baselines: each challenger is compared with the better one trained with its batch."""
POOL_ROUTERS = ("expert_choice", "expert_choice_batch", "expert_choice_batch_b48")
"""Expert choice selecting from a sequence, the batch, a 4x larger batch (equal tokens): the pool sweep."""
POOL_ONLY = ("expert_choice_batch", "expert_choice_batch_b48", "topk_aux_b48")
"""Rows that belong to the pool sweep's table only."""


def require_scipy():
    """scipy.stats, or a StudyError naming the extra (checked before any row trains)."""
    try:
        from scipy import stats
    except ImportError:
        raise StudyError(
            "the study's t-tests need scipy: pip install 'scipy>=1.10' (or the study extra, see docs/studies.md)"
        ) from None
    return stats


def mean_se(values: list[float]) -> tuple[float, float]:
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def paired_t(diffs: list[float]) -> tuple[float, float]:
    """The paired t-test of differences (one per seed) against zero: the statistic (mean / standard
    error) and its two-sided p with n - 1 degrees of freedom; NaN for one pair or no spread."""
    if len(diffs) < 2 or statistics.stdev(diffs) == 0:
        return float("nan"), float("nan")
    test = require_scipy().ttest_1samp(diffs, 0.0)
    return float(test.statistic), float(test.pvalue)


def t_halfwidth(se: float, n: int, level: float = 0.95) -> float:
    """Half the width of the two-sided t interval at ``level`` for a mean of n values with
    standard error ``se`` (n - 1 degrees of freedom); NaN below two values."""
    if n < 2 or math.isnan(se):
        return float("nan")
    return float(require_scipy().t.ppf(0.5 + level / 2, n - 1)) * se


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given; NaN stays NaN and is not counted
    in the family): the i-th smallest of m is max over j <= i of min(1, (m - j + 1) p_(j))."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(order)
    adjusted = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def decision(diff: float, p_holm: float, alpha: float = ALPHA) -> str:
    """The verdict of one comparison: better or worse (lower or higher causal loss, with the
    Holm-adjusted p below alpha), else not distinguished."""
    if math.isnan(p_holm) or p_holm >= alpha:
        return "not distinguished"
    return "better" if diff < 0 else "worse"


def batch_of(row: dict) -> int:
    return row["config"]["data"]["batch_size"]


def best_baseline(summaries: list[dict], batch: int) -> dict | None:
    """The summary of the better (by mean causal loss) dropless top-k baseline trained with
    ``batch`` among ``summaries`` (one panel), or None."""
    base = [s for s in summaries if s["router"] in BASELINES and s["batch_size"] == batch]
    return min(base, key=lambda s: s["causal_loss"]) if base else None


def pair(mine: dict[int, dict], theirs: dict[int, dict], key: str) -> list[float]:
    """Seed-paired differences of ``key`` (mine minus theirs) over the seeds both have."""
    return [mine[i][key] - theirs[i][key] for i in sorted(mine.keys() & theirs.keys())]


def compare(summary: dict, mine: dict[int, dict], theirs: dict[int, dict], baseline: str) -> None:
    """Add to ``summary`` the paired comparison with ``baseline``: causal and teacher-forced
    differences (mean ± se), the paired t-test and the 95% t interval of the causal difference."""
    diffs = pair(mine, theirs, "causal_loss")
    if not diffs:
        return
    d, se = mean_se(diffs)
    t, p = paired_t(diffs)
    d_tf, se_tf = mean_se(pair(mine, theirs, "teacher_forced_loss"))
    summary.update(baseline=baseline, paired_diff=d, paired_diff_se=se, paired_n=len(diffs), paired_t=t, paired_p=p)
    summary.update(paired_diff_tf=d_tf, paired_diff_tf_se=se_tf, paired_ci95=t_halfwidth(se, len(diffs)))
    summary["paired_ci95_tf"] = t_halfwidth(se_tf, len(diffs))


def correct(summaries: list[dict]) -> None:
    """Holm over the compared entries of one table (one panel): ``paired_p_holm`` and ``verdict``."""
    compared = [s for s in summaries if "paired_p" in s]
    for s, p in zip(compared, holm([s["paired_p"] for s in compared])):
        s["paired_p_holm"] = p
        s["verdict"] = decision(s["paired_diff"], p)


def _group(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["corpus"], r["size"], r["router"]), []).append(r)
    return groups


def _describe(key: tuple, rs: list[dict]) -> dict:
    corpus, size, router = key
    s = {"corpus": corpus, "size": size, "router": router, "seeds": sorted(r["seed"] for r in rs)}
    for k in ("teacher_forced_loss", "causal_loss", "leakage_gap", "max_vio", "active_experts_mean", "tokens_per_s"):
        s[k], s[k + "_se"] = mean_se([r[k] for r in rs])
    s["active_params"] = rs[0]["active_params"]
    s["dead_experts"] = max(r["dead_experts"] for r in rs)
    s["batch_size"] = batch_of(rs[0])
    s["causal_eval_batch"] = sorted({r.get("causal_eval_batch", r["config"]["eval"]["eval_batch_size"]) for r in rs})
    return s


def summarise(rows: list[dict], baseline: str | None = None) -> list[dict]:
    """One entry per corpus x size x router outside the pool sweep (which has its own table):
    means and standard errors over seeds, and the causal-loss difference from the better dropless
    top-k baseline (by mean causal loss; the other baseline is compared with it too; or from the
    router ``baseline``, a registered test's), paired by seed, with its t-test, 95% t interval,
    Holm-adjusted p over the panel's challengers and verdict, and the teacher-forced difference."""
    groups = {k: v for k, v in _group(rows).items() if k[2] not in POOL_ONLY}
    out = [_describe(k, v) for k, v in groups.items()]
    for panel in sorted({(s["corpus"], s["size"]) for s in out}):
        sub = [s for s in out if (s["corpus"], s["size"]) == panel]
        for s in sub:
            if baseline is None:
                best = best_baseline(sub, s["batch_size"])
            else:
                best = next((b for b in sub if b["router"] == baseline), None)
            if best is None or best is s:
                continue
            mine = {r["seed"]: r for r in groups[(*panel, s["router"])]}
            theirs = {r["seed"]: r for r in groups[(*panel, best["router"])]}
            compare(s, mine, theirs, best["router"])
        correct(sub)
    return out


def pool_tokens(row: dict) -> int:
    """Tokens one expert-choice selection ranks in training: a sequence (T) or the batch (B x T)."""
    data = row["config"]["data"]
    return data["seq_len"] * (data["batch_size"] if row["router_options"].get("group") == "batch" else 1)


def pool_sweep(rows: list[dict]) -> list[dict]:
    """Per corpus x size x pool router: its batch and training pool, the losses (mean ± se over
    seeds), the sequences routed together when its causal loss was measured, and the difference
    from the better dropless top-k baseline trained with the same batch, paired by seed (causal
    with t-test and Holm over the panel's pools, teacher-forced)."""
    groups = _group(rows)
    out = []
    for corpus, size in sorted({(r["corpus"], r["size"]) for r in rows}):
        described = [_describe(k, v) for k, v in groups.items() if k[:2] == (corpus, size)]
        panel = []
        for s in described:
            if s["router"] not in POOL_ROUTERS:
                continue
            mine = {r["seed"]: r for r in groups[(corpus, size, s["router"])]}
            s["pool"] = pool_tokens(next(iter(mine.values())))
            best = best_baseline(described, s["batch_size"])
            if best is not None:
                compare(s, mine, {r["seed"]: r for r in groups[(corpus, size, best["router"])]}, best["router"])
            panel.append(s)
        correct(panel)
        out += sorted(panel, key=lambda s: POOL_ROUTERS.index(s["router"]))
    return out


def registered_rows(registration: dict, rows: list[dict]) -> list[dict]:
    """The stored rows that belong to a registered test: its corpus and size, its baseline and
    challengers, its seeds."""
    labels, seeds = {registration["baseline"], *registration["challengers"]}, set(registration["seeds"])
    where = (registration["corpus"], registration["size"])
    return [r for r in rows if (r["corpus"], r["size"]) == where and r["router"] in labels and r["seed"] in seeds]


def registered_verdict(registration: dict, rows: list[dict]) -> dict:
    """The registered test on the stored rows: each challenger's causal-loss differences from the
    baseline paired over exactly the registered seeds, the paired t-test, Holm over the
    challengers at the registered alpha. StudyError while a registered row is missing."""
    if registration.get("test") != "paired t-test, two-sided, Holm over the challengers":
        raise StudyError(f"unknown registered test {registration.get('test')!r}")
    seeds, alpha = registration["seeds"], registration["alpha"]
    by = {(r["router"], r["seed"]): r for r in registered_rows(registration, rows)}
    labels = [registration["baseline"], *registration["challengers"]]
    missing = [f"{label} seed {s}" for label in labels for s in seeds if (label, s) not in by]
    if missing:
        raise StudyError(f"{len(missing)} registered rows are not stored yet: {', '.join(missing[:6])} ...")
    base = {s: by[registration["baseline"], s] for s in seeds}
    results = []
    for label in registration["challengers"]:
        mine = {s: by[label, s] for s in seeds}
        diffs = pair(mine, base, "causal_loss")
        d, se = mean_se(diffs)
        t, p = paired_t(diffs)
        ahead = sum(x < 0 for x in diffs)
        results.append(
            dict(
                challenger=label,
                diff=d,
                se=se,
                ci95=t_halfwidth(se, len(diffs)),
                t=t,
                p=p,
                ahead_on=f"{ahead} of {len(diffs)} seeds",
            )
        )
    for r, p in zip(results, holm([r["p"] for r in results])):
        r["p_holm"] = p
        r["decision"] = decision(r["diff"], p, alpha)
    return {"challengers": results, "alpha": alpha, "n_seeds": len(seeds)}
