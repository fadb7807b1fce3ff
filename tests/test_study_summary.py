"""The router study's summary (experiments/study_stats.py ``summarise``): each challenger's
difference from the better dropless top-k baseline is paired by seed (the paired standard error
and Student's t of the per-seed differences), and the better baseline is the one with the lower
mean CAUSAL loss, the loss decoding sees, not the teacher-forced one. Rows are small dicts with
the fields ``summarise`` reads (all trained with one batch size); every expected figure is
worked out by hand below."""

from __future__ import annotations

import math
import sys

import pytest
from extras import needs
from helpers import ROOT
from helpers import study_row as row

sys.path.insert(0, str(ROOT / "experiments"))
import study_stats as stats  # noqa: E402

pytestmark = needs("scipy", "study")  # paired t-tests


def by_router(rows: list[dict], corpus: str = "c", size: str = "s") -> dict[str, dict]:
    return {s["router"]: s for s in stats.summarise(rows) if (s["corpus"], s["size"]) == (corpus, size)}


def test_differences_are_paired_by_seed():
    """topk_aux ranks its seeds 0 < 1 < 2, top_p ranks them 1 < 0 < 2, and the challenger's rows
    come in another order than the baseline's, with a seed (3) the baseline lacks.

    Per-seed differences (top_p - topk_aux): +0.10, -0.05, -0.02; mean 0.01; deviations 0.09,
    -0.06, -0.03; sample variance 0.0126 / 2 = 0.0063; standard error sqrt(0.0063 / 3) =
    sqrt(0.0021) = 0.045826; t = 0.01 / 0.045826 = 0.21822 with 2 degrees of freedom, whose
    two-sided p is 1 - |t| / sqrt(2 + t^2) in closed form. Unpaired, the same means would give a
    standard error of sqrt(0.1^2 / 3 + 0.0656^2 / 3) = 0.0690."""
    rows = [
        *(row("topk_aux", i, x) for i, x in enumerate((3.50, 3.60, 3.70))),
        *(row("topk_lossfree", i, 3.80) for i in range(3)),
        row("top_p", 2, 3.68),
        row("top_p", 3, 3.20),  # no baseline row for seed 3: not paired
        row("top_p", 0, 3.60),
        row("top_p", 1, 3.55),
    ]
    s = by_router(rows)["top_p"]
    assert s["baseline"] == "topk_aux" and s["paired_n"] == 3, s
    se = math.sqrt(0.0021)
    t = 0.01 / se
    assert s["paired_diff"] == pytest.approx(0.01, abs=1e-12)
    assert s["paired_diff_se"] == pytest.approx(se, rel=1e-9)
    assert s["paired_t"] == pytest.approx(t, rel=1e-9)
    assert s["paired_p"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-9)


def test_the_baseline_is_the_better_top_k_by_causal_loss():
    """In panel a, topk_aux has the lower causal loss and topk_lossfree the lower teacher-forced
        loss; in panel b the other way round (and in both the teacher-forced winner's rows come
    first, so neither the first baseline listed nor a fixed one is right in both). The challenger is compared with the causal winner in
        both, and its paired differences (causal and teacher-forced) are against that baseline."""
    rows = []
    for corpus, causal_winner, tf_winner in (("a", "topk_aux", "topk_lossfree"), ("b", "topk_lossfree", "topk_aux")):
        for i in range(2):
            rows.append(row(tf_winner, i, causal=3.70, tf=3.40, corpus=corpus))
            rows.append(row(causal_winner, i, causal=3.60, tf=3.55, corpus=corpus))
            rows.append(row("expert_threshold", i, causal=3.65 + 0.01 * i, tf=3.50, corpus=corpus))
    for corpus, winner in (("a", "topk_aux"), ("b", "topk_lossfree")):
        s = by_router(rows, corpus)["expert_threshold"]
        assert s["baseline"] == winner, (corpus, s["baseline"])
        assert s["paired_diff"] == pytest.approx(0.055, abs=1e-12)  # 3.65 - 3.60, 3.66 - 3.60
        assert s["paired_diff_tf"] == pytest.approx(-0.05, abs=1e-12)  # 3.50 - 3.55, not 3.50 - 3.40


def test_dead_experts_are_the_worst_seeds():
    """The table's dead-expert count of a router is the most any of its seeds left dead (a
    failure of one seed is not averaged away)."""
    rows = [row("remoe", i, 3.6, dead=d) for i, d in enumerate((0, 2, 1))]
    assert by_router(rows)["remoe"]["dead_experts"] == 2


def test_the_better_baseline_is_the_reference_not_a_challenger_of_itself():
    """topk_aux (lower causal loss) is the reference: it gets no comparison, no verdict, and is
    not in the Holm family that topk_lossfree and top_p share."""
    rows = [row("topk_aux", i, 3.5 + 0.1 * i) for i in range(3)]
    rows += [row("topk_lossfree", i, x) for i, x in enumerate((3.8, 3.95, 4.05))]
    rows += [row("top_p", i, x) for i, x in enumerate((3.55, 3.62, 3.77))]
    got = by_router(rows)
    assert not {"baseline", "paired_p", "verdict"} & set(got["topk_aux"])
    assert got["topk_lossfree"]["baseline"] == got["top_p"]["baseline"] == "topk_aux"
    # a family of two: the smaller p doubled (Holm), the larger kept as it is or raised to it
    p_lf, p_tp = got["topk_lossfree"]["paired_p"], got["top_p"]["paired_p"]
    assert got["top_p"]["paired_p_holm"] == pytest.approx(max(min(1.0, 2 * min(p_lf, p_tp)), p_tp), rel=1e-12)
