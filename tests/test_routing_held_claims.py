"""``moe.routing.held_claims``: a module holding several routers makes each claim only where
every router inside it makes it, worked out here by hand for a mixed pair (what a model whose
blocks route differently promises), and all four claims for a module holding none."""

from __future__ import annotations

from torch import nn

import moe
from moe.routing import Claims, held_claims


def test_a_module_claims_what_every_router_inside_it_claims():
    topk = moe.build_router("topk", d_model=8, num_experts=4)  # causal, batch-invariant, decode-consistent
    capacity = moe.build_router("capacity", d_model=8, num_experts=4)  # capacity sized from T: not decode-consistent
    expert_choice = moe.build_router("expert_choice", d_model=8, num_experts=4, group="batch")  # none of the four
    assert held_claims(nn.ModuleList([topk, capacity])) == Claims(
        causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=False
    )
    assert held_claims(nn.ModuleList([capacity, expert_choice])) == Claims(
        causal_train=False, causal_eval=False, batch_invariant=False, decode_consistent=False
    )
    assert held_claims(nn.Sequential(nn.Linear(8, 8))) == Claims(True, True, True, True)
    layer = moe.MoELayer(8, 16, 4, router=capacity)
    assert layer.claims == capacity.claims
