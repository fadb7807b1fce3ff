"""The router study's report cells (experiments/study_report.py) by hand: a mean with its
standard error, or alone where one seed gives none; a figure's 95% t interval (0 where
undefined); a panel's caption counting the challengers that are better, worse and neither."""

from __future__ import annotations

import math
import sys

import pytest
from extras import needs
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import study_report as report  # noqa: E402

pytestmark = needs("scipy", "study")  # t quantiles


def test_a_mean_carries_its_standard_error_only_where_there_is_one():
    assert report.pm(1.23456, 0.01) == "1.2346 ± 0.0100"
    assert report.pm(1.23456, math.nan) == "1.2346"
    assert report.pm(-0.00001, 0.002, sign=True) == "0.0000 ± 0.0020"  # no -0.0000


def test_an_interval_is_the_t_half_width_or_zero_for_one_seed():
    """Three seeds: 2 degrees of freedom, whose 97.5% t quantile is 0.95 / sqrt(2 * 0.975 * 0.025)
    (closed form for 2 degrees of freedom): 4.3027 standard errors."""
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert report._interval({"loss_se": 0.1, "seeds": [0, 1, 2]}, "loss") == pytest.approx(0.1 * t2, rel=1e-9)
    assert report._interval({"loss_se": math.nan, "seeds": [0]}, "loss") == 0.0


def test_a_caption_counts_the_challengers_neither_better_nor_worse():
    def entry(router, verdict, t=2.0):
        return {"router": router, "paired_diff": -0.01, "paired_t": t, "verdict": verdict, "baseline": "topk_aux"}

    sub = [
        entry("ec_threshold", "better"),
        entry("expert_choice", "worse"),
        entry("top_p", "not distinguished", 0.4),
        entry("remoe", "not distinguished", 0.1),
        entry("dense", "", math.nan),  # one seed: no test
    ]
    assert report.panel_caption(sub) == (
        f"vs topk_aux, causal loss, Holm over 4 tests at {report.ALPHA}: better ec_threshold; worse expert_choice; "
        "the other 2 not distinguished"
    )
    assert report.panel_caption(sub[-1:]) == "no paired test"
