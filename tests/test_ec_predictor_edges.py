"""The expert-choice predictor in training, worked out here in float64 from the training
routing's own pairs (expert choice's selection): ``predictor_accuracy`` is the share of the N*E
(token, expert) pairs where the predictor's sign agrees with it, and the aux loss is
``predictor_loss_coef`` times the predictor's binary cross-entropy against it (z-loss off)."""

from __future__ import annotations

import pytest
import torch
from helpers import identity_router


def test_predictor_accuracy_is_the_share_of_pairs_it_predicts():
    e = 4
    r = identity_router("ec_predictor", e, capacity_factor=1.0).train()
    x = torch.randn(2, 6, e, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    routing = r(x)
    with torch.no_grad():
        predicted_NE = r.predictor(x.reshape(-1, e)) > 0
    chosen_NE = routing.mask().reshape(-1, e)
    agree = (predicted_NE == chosen_NE).double().mean().item()
    assert 0 < agree < 1
    assert routing.stats["predictor_accuracy"].item() == pytest.approx(agree, rel=1e-6)


def test_aux_loss_is_the_coefficient_times_the_predictors_cross_entropy():
    e = 4
    r = identity_router("ec_predictor", e, capacity_factor=1.0, z_loss_coef=0.0, predictor_loss_coef=0.25).train()
    x = torch.randn(2, 6, e, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    routing = r(x)
    with torch.no_grad():
        z_NE = r.predictor(x.reshape(-1, e))
    y_NE = routing.mask().reshape(-1, e).double()
    bce = (torch.log1p(torch.exp(z_NE)) - y_NE * z_NE).mean().item()
    assert routing.aux_loss.item() == pytest.approx(0.25 * bce, rel=1e-12)
