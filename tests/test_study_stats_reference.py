"""experiments/study_stats.py against independent references: closed-form Student t for 2
degrees of freedom, Holm's step-down procedure written out from its definition, and the
standard of evidence "p below alpha" at its boundary. Each summary figure (the causal and the
teacher-forced differences and their 95% t intervals) is checked against its own inputs."""

from __future__ import annotations

import itertools
import math
import random
import sys

import pytest
from extras import needs
from helpers import ROOT
from helpers import study_row as row

sys.path.insert(0, str(ROOT / "experiments"))
import study_stats as stats  # noqa: E402

pytestmark = needs("scipy", "study")  # paired t-tests


def t2_quantile(q: float) -> float:
    """Student t quantile with 2 degrees of freedom, closed form: (2q - 1) / sqrt(2 q (1 - q))."""
    return (2 * q - 1) / math.sqrt(2 * q * (1 - q))


def holm_reference(pvalues: list[float]) -> list[float]:
    """Holm from its definition: p_(i) adjusted = max over j <= i of min(1, (m - j + 1) p_(j)),
    ranks from 1, by brute force over every p (NaN left out of the family)."""
    family = [p for p in pvalues if not math.isnan(p)]
    m = len(family)
    out = []
    for p in pvalues:
        if math.isnan(p):
            out.append(float("nan"))
            continue
        ranked = sorted(family)
        i = ranked.index(p) + 1 + sum(1 for q in ranked if q == p) - 1  # ties: the last rank of equal p
        out.append(max(min(1.0, (m - j + 1) * ranked[j - 1]) for j in range(1, i + 1)))
    return out


def test_the_teacher_forced_interval_is_that_of_the_teacher_forced_differences():
    """Three seeds: causal differences (top_p - topk_aux) +0.10, -0.05, -0.02 and teacher-forced
    differences 0, +0.3, -0.3, whose standard errors differ (0.0458 and 0.1732): each interval is
    t(0.975, 2 df) times its own standard error."""
    base = [(3.50, 3.00), (3.60, 3.00), (3.70, 3.00)]
    mine = [(3.60, 3.00), (3.55, 3.30), (3.68, 2.70)]
    rows = [row("topk_aux", i, c, tf) for i, (c, tf) in enumerate(base)]
    rows += [row("top_p", i, c, tf) for i, (c, tf) in enumerate(mine)]
    s = next(s for s in stats.summarise(rows) if s["router"] == "top_p")
    q = t2_quantile(0.975)
    se_causal = math.sqrt(0.0063 / 3)
    se_tf = math.sqrt((0.3**2 + 0.3**2) / 2 / 3)
    assert s["paired_diff_se"] == pytest.approx(se_causal, rel=1e-9)
    assert s["paired_diff_tf_se"] == pytest.approx(se_tf, rel=1e-9)
    assert s["paired_ci95"] == pytest.approx(q * se_causal, rel=1e-9)
    assert s["paired_ci95_tf"] == pytest.approx(q * se_tf, rel=1e-9)


def test_t_halfwidth_matches_the_closed_form_quantile_at_two_degrees_of_freedom():
    for level in (0.5, 0.9, 0.95, 0.99):
        assert stats.t_halfwidth(0.02, 3, level) == pytest.approx(0.02 * t2_quantile(0.5 + level / 2), rel=1e-9)


def test_paired_t_is_two_sided_whatever_the_sign():
    """df = 2: two-sided p = 1 - |t| / sqrt(2 + t^2), the same for a difference and its negative."""
    for diffs in ([0.1, 0.2, 0.35], [-0.1, -0.2, -0.35], [0.3, -0.1, 0.05]):
        t, p = stats.paired_t(diffs)
        assert p == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-9)
        assert stats.paired_t([-d for d in diffs])[1] == pytest.approx(p, rel=1e-12)


def test_holm_equals_its_definition_on_random_families():
    rng = random.Random(0)
    for m in range(1, 7):
        for _ in range(40):
            ps = [rng.choice([rng.random(), rng.random() * 0.05, float("nan")]) for _ in range(m)]
            assert stats.holm(ps) == pytest.approx(holm_reference(ps), nan_ok=True, rel=1e-12), ps
    for ps in itertools.permutations([0.001, 0.02, 0.02, 0.3]):
        got = stats.holm(list(ps))
        assert got == pytest.approx(holm_reference(list(ps)), rel=1e-12)
        # adjusted p never decrease with the raw p (step-down monotone) and never fall below it
        pairs = sorted(zip(ps, got))
        assert all(a[1] <= b[1] for a, b in zip(pairs, pairs[1:])) and all(g >= p for p, g in pairs)


def test_a_difference_is_called_only_with_p_below_alpha():
    """ "below ALPHA": a Holm p equal to alpha does not distinguish."""
    assert stats.decision(-0.1, stats.ALPHA) == "not distinguished"
    assert stats.decision(-0.1, 0.01, alpha=0.01) == "not distinguished"
    assert stats.decision(-0.1, math.nextafter(stats.ALPHA, 0)) == "better"
    assert stats.decision(0.1, math.nextafter(stats.ALPHA, 0)) == "worse"
    assert stats.decision(-0.1, float("nan")) == "not distinguished"


def p_two_sided_3df(t: float) -> float:
    """Student t, 3 degrees of freedom, two-sided p in closed form."""
    x = abs(t) / math.sqrt(3)
    return 1 - 2 / math.pi * (math.atan(x) + x / (1 + x * x))


def test_the_registered_verdict_against_closed_forms():
    """Four registered seeds, rows shuffled and with an unregistered seed: per challenger the
    seed-paired differences, the t-test (3 df, closed form), Holm over the two challengers, and
    the seeds it is strictly ahead on (a tie is not ahead)."""
    reg = {
        "test": "paired t-test, two-sided, Holm over the challengers",
        "seeds": [0, 1, 2, 3],
        "alpha": 0.05,
        "baseline": "topk_aux",
        "challengers": ["a", "b"],
        "corpus": "c",
        "size": "s",
    }
    base = [3.5, 3.6, 3.7, 3.8]
    mine = {"a": [3.4, 3.6, 3.65, 3.9], "b": [3.3, 3.45, 3.5, 3.62]}
    rows = [row("topk_aux", s, c, c) for s, c in enumerate(base)]
    rows += [row(r, s, c, c) for r, cs in mine.items() for s, c in enumerate(cs)]
    rows += [row("a", 9, 0.0, 0.0), row("topk_aux", 9, 9.0, 9.0)]
    random.Random(1).shuffle(rows)
    out = stats.registered_verdict(reg, rows)
    got = {c["challenger"]: c for c in out["challengers"]}
    ps = {}
    for r, cs in mine.items():
        d = [x - y for x, y in zip(cs, base)]
        m = sum(d) / 4
        se = math.sqrt(sum((x - m) ** 2 for x in d) / 3 / 4)
        ps[r] = p_two_sided_3df(m / se)
        assert got[r]["diff"] == pytest.approx(m, abs=1e-12) and got[r]["se"] == pytest.approx(se, rel=1e-9)
        assert got[r]["t"] == pytest.approx(m / se, rel=1e-9) and got[r]["p"] == pytest.approx(ps[r], rel=1e-7)
        assert got[r]["ahead_on"] == f"{sum(x < -1e-12 for x in d)} of 4 seeds"
    assert got["a"]["ahead_on"] == "2 of 4 seeds"  # -0.1, a tie, -0.05, +0.1
    holm = holm_reference([ps["a"], ps["b"]])
    assert [got["a"]["p_holm"], got["b"]["p_holm"]] == pytest.approx(holm, rel=1e-7)
    for r, p in zip(("a", "b"), holm):
        assert got[r]["decision"] == ("not distinguished" if p >= 0.05 else "better" if got[r]["diff"] < 0 else "worse")
