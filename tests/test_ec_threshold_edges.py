"""Expert threshold routing (``ec_threshold``) at edges a mutation pass found open, each against
a float64 reference written here: the threshold before any update is 1/E, ``normalize`` divides
by the scores of the token's own experts (then ``route_scale``), a step whose cut-offs are NaN
leaves the thresholds as they were, and a population capacity above every token cuts at the
lowest score's bin."""

from __future__ import annotations

import pytest
import torch
from helpers import assignments, identity_router


def test_before_the_first_update_a_token_takes_every_expert_scoring_at_least_one_over_e():
    e = 4
    r = identity_router("ec_threshold", e).eval()
    x = torch.randn(2, 7, e, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    probs_NE = torch.softmax(x.reshape(-1, e), -1)
    want = [(n, j) for n in range(probs_NE.shape[0]) for j in range(e) if probs_NE[n, j] >= 1 / e]
    assert torch.equal(r.threshold, torch.full((e,), 1 / e, dtype=torch.float64))
    routing = r(x)
    assert assignments(routing) == want
    assert 0 < len(want) < probs_NE.numel()  # the cut-off decides something here


def test_normalize_divides_by_the_scores_of_the_tokens_own_experts_then_scales():
    e = 4
    r = identity_router("ec_threshold", e, normalize=True, route_scale=2.5).eval()
    x = torch.randn(3, 5, e, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 2
    probs_NE = torch.softmax(x.reshape(-1, e), -1)
    routing = r(x)
    for n, j, w in zip(routing.token.tolist(), routing.expert.tolist(), routing.weight.tolist()):
        own = sum(probs_NE[n, i].item() for i in range(e) if probs_NE[n, i] >= 1 / e)
        assert w == pytest.approx(2.5 * probs_NE[n, j].item() / own, rel=1e-12)
    assert routing.experts_per_token().min() < e  # some token leaves an expert out


def test_a_step_of_nan_scores_leaves_the_thresholds_as_they_were():
    e = 4
    r = identity_router("ec_threshold", e, momentum=0.5).train()
    gen = torch.Generator().manual_seed(7)
    r(torch.randn(2, 6, e, generator=gen, dtype=torch.float64))
    r.update_after_step()
    before = r.threshold.clone()
    assert torch.isfinite(before).all() and not torch.equal(before, torch.full((e,), 1 / e, dtype=torch.float64))
    x = torch.randn(2, 6, e, generator=gen, dtype=torch.float64)
    x[1] = float("nan")  # a whole sequence: its cut-offs are NaN
    r(x)
    r.update_after_step()
    assert torch.equal(r.threshold, before)


def test_a_population_capacity_above_every_token_cuts_at_the_lowest_scores_bin():
    """capacity_factor > E: each expert would take the whole population (the fraction is capped
    at 1), so its cut-off is the lower edge of the bin of its lowest score."""
    e, bins = 2, 8
    r = identity_router("ec_threshold", e, statistic="population", capacity_factor=4.0, population_bins=bins)
    r.momentum = 0.0  # the threshold is this step's cut-off
    x = torch.randn(2, 6, e, generator=torch.Generator().manual_seed(8), dtype=torch.float64) / 2
    r.train()(x)
    r.update_after_step()
    lowest_E = torch.softmax(x.reshape(-1, e), -1).min(0).values
    assert torch.allclose(r.threshold, torch.floor(lowest_E * bins) / bins, rtol=0, atol=1e-12)
    assert bool((r.threshold > 0).all())
