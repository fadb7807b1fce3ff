"""Top-p's dynamic loss (arXiv 2403.07652): ``entropy_loss_coef`` times the mean entropy of the
router's softmax, added to the aux loss (which it lowers by sharpening), against float64."""

from __future__ import annotations

import pytest
import torch
from helpers import identity_router


def test_aux_loss_is_the_coefficient_times_the_mean_router_entropy():
    e = 4
    r = identity_router("top_p", e, aux_loss_coef=0.0, z_loss_coef=0.0, entropy_loss_coef=0.3)
    x = torch.randn(2, 5, e, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    p_NE = torch.softmax(x.reshape(-1, e), -1)
    entropy = -(p_NE * p_NE.log()).sum(-1).mean().item()
    assert r(x).aux_loss.item() == pytest.approx(0.3 * entropy, rel=1e-12)
