"""The routing mechanisms an audit report names (``AuditReport.mechanisms``): those of the
target's routers that claim a leak in one of the audited modes, worked out by hand from the
routers' claims (a predictor router leaks in training only; capacity by score in both)."""

from __future__ import annotations

from types import SimpleNamespace

import moe
from moe.audit.engine import _mechanisms
from moe.audit.report import CAPACITY_BY_SCORE, EXPERT_CHOICE


def test_a_router_is_named_in_the_modes_where_it_claims_a_leak():
    routers = [
        moe.build_router("topk", d_model=8, num_experts=4),
        moe.build_router("ec_predictor", d_model=8, num_experts=4),  # causal in eval only
        moe.build_router("capacity", d_model=8, num_experts=4, priority="score"),  # causal in neither
    ]
    at = SimpleNamespace(routers=routers)
    assert _mechanisms(at, ("train", "eval")) == [EXPERT_CHOICE, CAPACITY_BY_SCORE]
    assert _mechanisms(at, ("train",)) == [EXPERT_CHOICE, CAPACITY_BY_SCORE]
    assert _mechanisms(at, ("eval",)) == [CAPACITY_BY_SCORE]
    assert _mechanisms(SimpleNamespace(routers=routers[:1]), ("train", "eval")) == []
