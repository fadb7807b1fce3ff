"""The expert-choice predictor's ``predictor_accuracy`` in training: the share of the N*E
(token, expert) pairs where the predictor's sign agrees with expert choice's selection (the
training routing's own pairs), worked out here in float64."""

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
