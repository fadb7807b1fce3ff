"""The distribution regime's per-comparison level is Bonferroni over every comparison a mode
can make: each forward probe's screened comparisons (at most MAX_DISTRIBUTION_COMPARISONS) and
one confirmation of a variant that moved in another mode, so that together they spend ALPHA."""

from __future__ import annotations

import pytest

from moe.audit.comparator import ALPHA, MAX_DISTRIBUTION_COMPARISONS, per_comparison_alpha


@pytest.mark.parametrize("forward_probes", [1, 3, 7])
def test_every_comparison_of_a_mode_together_spends_alpha(forward_probes):
    comparisons = forward_probes * (MAX_DISTRIBUTION_COMPARISONS + 1)
    assert per_comparison_alpha(forward_probes) * comparisons == pytest.approx(ALPHA, rel=1e-12)
    assert per_comparison_alpha(0) == per_comparison_alpha(1)  # no such probe: the level of one
