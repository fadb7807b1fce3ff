"""A mistyped router option is refused in one line that lists the router's valid options, from
Python (``build_router``, ``MoELayer``) and from the trainer's ``--router-option``; no option
a router takes is refused."""

from __future__ import annotations

import pytest
from test_train_cli import RUN, refused

import moe
from moe.audit.suite import ROUTER_CONFIGS
from moe.routers import router_options
from moe.routing import registered_routers

CAPACITY_OPTIONS = (
    "capacity_factor, priority, group, capacity_scope, top_k, gate, pre_softmax, normalize, route_scale, "
    "num_expert_groups, num_limited_groups, balance_rate, aux_loss_coef, seq_aux_loss_coef, global_aux_loss_coef, "
    "z_loss_coef, check_finite, router_dtype"
)
"""CapacityRouter's own keywords, then TokenChoiceBase's, then Router's (read off their signatures)."""


def test_a_mistyped_option_lists_the_valid_ones_in_one_line():
    with pytest.raises(ValueError) as e:
        moe.MoELayer(d_model=16, d_ff=32, num_experts=4, router="capacity", capacity_factr=1.0)
    assert (
        str(e.value)
        == f"bad options for router 'capacity': no option 'capacity_factr'; its options: {CAPACITY_OPTIONS}"
    )


def test_every_option_the_audit_suite_and_the_readme_use_is_valid():
    readme_topk = ["top_k", "gate", "pre_softmax", "normalize", "route_scale", "num_expert_groups"]
    readme_topk += ["num_limited_groups", "balance_rate", "aux_loss_coef", "seq_aux_loss_coef", "global_aux_loss_coef"]
    used = [*ROUTER_CONFIGS, ("topk", dict.fromkeys(readme_topk)), ("topk", {"null_experts": 4})]
    for name, options in used:
        assert set(options) <= set(router_options(registered_routers()[name])), (name, options)
    for name, options in ROUTER_CONFIGS:
        moe.build_router(name, d_model=8, num_experts=4, **options)


def test_the_trainer_refuses_a_mistyped_router_option_in_one_line(capsys):
    err = refused([*RUN, "--steps", "1", "--router", "capacity", "--router-option", "capacity_factr=1.0"], capsys)
    assert "\n" not in err and err.endswith(f"no option 'capacity_factr'; its options: {CAPACITY_OPTIONS}"), err
