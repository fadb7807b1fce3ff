"""A standalone ``SwiGLUExperts`` (what an ``MoELayer`` built outside a model starts from; a
model re-initialises its experts) draws its matrices from N(0, 1/fan_in): gate and up from D,
down from the expert width F. D 32 and F 128, so the two spreads differ by 2x; 16384 draws
each, within 5%."""

from __future__ import annotations

import math

import pytest
import torch

from moe.experts import SwiGLUExperts


def test_each_expert_matrix_starts_at_one_over_its_fan_in():
    torch.manual_seed(0)
    experts = SwiGLUExperts(4, 32, 128)
    for name, fan_in in (("w_gate", 32), ("w_up", 32), ("w_down", 128)):
        p = getattr(experts, name).detach().double()
        assert abs(float(p.mean())) < 4 / math.sqrt(fan_in * p.numel()), name
        assert float(p.std()) == pytest.approx(fan_in**-0.5, rel=0.05), name
