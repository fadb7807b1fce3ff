"""Built-in routers; importing this package registers them by name, and builds any registered
router by name (``build_router``). :data:`ROUTER_TABLE` is the one table of router
configurations that the audit's built-in suite, the tests and the router study read.

A new router is one file here (a :class:`moe.routing.Router` subclass, or of a family's base,
:class:`TokenChoiceBase` or :class:`ExpertChoiceBase`, when it extends that family's rule; the
hooks it implements are named in ``Router``'s docstring),
imported below to register it, plus a row of :data:`ROUTER_TABLE` and its tests."""

import inspect
from dataclasses import dataclass

from moe.routers.capacity import CapacityRouter
from moe.routers.doc_pool import DocumentPoolRouter
from moe.routers.ec_predictor import ExpertChoicePredictorRouter
from moe.routers.ec_threshold import ExpertChoiceThresholdRouter
from moe.routers.expert_choice import ExpertChoiceBase, ExpertChoiceRouter
from moe.routers.hash import HashRouter
from moe.routers.quantile import QuantileBalancingRouter
from moe.routers.quantile_global import GlobalQuantileBalancingRouter
from moe.routers.remoe import ReLURouter
from moe.routers.seq_topk import SeqTopKRouter
from moe.routers.sinkhorn import SinkhornRouter
from moe.routers.token_choice import TokenChoiceBase, TopKRouter
from moe.routers.token_rounding import TokenRoundingRouter
from moe.routers.top_p import TopPRouter
from moe.routing import Router, registered_routers

USES = ("audit", "tests")
"""The suites that read :data:`ROUTER_TABLE` by use: ``"audit"``, the built-in targets of
``moe-audit`` (each configuration alone, in an MoELayer and in the tiny model:
``moe.audit.suite``); ``"tests"``, the tests parametrised over every router configuration
(``tests/helpers.py``). ``experiments/router_study.py`` names its arms by label."""


@dataclass(frozen=True)
class RouterConfig:
    """One row of :data:`ROUTER_TABLE`: a registered router under one set of options."""

    router: str
    """A registered router name (:func:`list_routers`)."""
    options: dict
    """Its options (:func:`build_router`'s keywords)."""
    uses: tuple[str, ...] = ()
    """The suites of :data:`USES` that run it (none: a row that a study names by its label)."""


ROUTER_TABLE: dict[str, RouterConfig] = {
    "topk_aux": RouterConfig("topk", {"top_k": 2}, ("audit", "tests")),
    "topk1_sigmoid": RouterConfig("topk", {"top_k": 1, "gate": "sigmoid"}, ("tests",)),
    "topk_lossfree": RouterConfig("topk", {"top_k": 2, "aux_loss_coef": 0.0, "balance_rate": 1e-3}),
    # capacity factor 1.0 makes capacity bind at the audit's small shapes; the tests drop at 0.75
    "capacity_position": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "sequence"}, ("audit",)
    ),
    "capacity_position_batch": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "batch"}, ("audit",)
    ),
    "capacity_position_prefix": RouterConfig(
        "capacity",
        {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "sequence", "capacity_scope": "prefix"},
        ("audit",),
    ),
    "capacity_score": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "score", "group": "sequence"}, ("audit",)
    ),
    "capacity_score_batch": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "score", "group": "batch"}, ("audit",)
    ),
    "capacity_choice": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "choice", "group": "sequence"}, ("audit",)
    ),
    "capacity_position_cf075": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 0.75, "priority": "position"}, ("tests",)
    ),
    "capacity_position_batch_cf075": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 0.75, "priority": "position", "group": "batch"}, ("tests",)
    ),
    "capacity_score_cf075": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 0.75, "priority": "score"}, ("tests",)
    ),
    "capacity_choice_cf075": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 0.75, "priority": "choice"}, ("tests",)
    ),
    "expert_choice_cf1": RouterConfig(
        "expert_choice", {"capacity_factor": 1.0, "group": "sequence"}, ("audit", "tests")
    ),
    "expert_choice_batch_cf1": RouterConfig(
        "expert_choice", {"capacity_factor": 1.0, "group": "batch"}, ("audit", "tests")
    ),
    "ec_threshold_cf1": RouterConfig("ec_threshold", {"capacity_factor": 1.0}, ("audit", "tests")),
    "expert_threshold_sigmoid_cf1": RouterConfig(
        "ec_threshold",
        {"capacity_factor": 1.0, "statistic": "population", "score": "sigmoid", "aux_loss_coef": 0.0},
        ("audit", "tests"),
    ),
    "ec_predictor_cf1": RouterConfig("ec_predictor", {"capacity_factor": 1.0}, ("audit", "tests")),
    "ec_threshold": RouterConfig("ec_threshold", {"capacity_factor": 2.0}),
    "expert_threshold": RouterConfig(
        "ec_threshold", {"capacity_factor": 2.0, "statistic": "population", "aux_loss_coef": 0.0}
    ),
    "remoe": RouterConfig("remoe", {"top_k": 2}, ("audit", "tests")),
    "top_p": RouterConfig("top_p", {"target_experts": 2.0}, ("audit", "tests")),
    "topk_null4": RouterConfig("topk", {"top_k": 2, "null_experts": 4}, ("audit",)),
    "topk_null2": RouterConfig("topk", {"top_k": 2, "null_experts": 2}, ("tests",)),
    "null_experts": RouterConfig("topk", {"top_k": 4, "null_experts": 8}),
    "capacity_prefix": RouterConfig(
        "capacity", {"top_k": 2, "capacity_factor": 1.25, "priority": "position", "capacity_scope": "prefix"}
    ),
    "expert_choice": RouterConfig("expert_choice", {"capacity_factor": 2.0}),
    "ec_predictor": RouterConfig("ec_predictor", {"capacity_factor": 2.0}),
    # Megatron-Core's quantile balancing (its defaults: no aux loss, ema 0)
    "quantile": RouterConfig("quantile", {"top_k": 2}, ("audit", "tests")),
    # SeqTopK: a sequence's best T*k scores, decoded online
    "seq_topk": RouterConfig("seq_topk", {"top_k": 2}, ("audit", "tests")),
    # top-k routed as DeepSeek-V3 routes (sigmoid, balance bias, 2 groups of which a token keeps 1,
    # a route scale) with its sequence and global balance losses, for E = 4 experts
    "topk_deepseek_v3": RouterConfig(
        "topk",
        {
            "top_k": 2,
            "gate": "sigmoid",
            "num_expert_groups": 2,
            "num_limited_groups": 1,
            "route_scale": 2.5,
            "balance_rate": 0.1,
            "seq_aux_loss_coef": 0.01,
            "global_aux_loss_coef": 0.01,
        },
        ("tests",),
    ),
    # Kimi K3's global-step quantile balancing
    "quantile_global": RouterConfig("quantile_global", {"top_k": 2}, ("tests",)),
    # S-BASE: top-k of a Sinkhorn-balanced assignment in training, of the scores at inference
    "sinkhorn": RouterConfig("sinkhorn", {"top_k": 2}, ("audit", "tests")),
    # expert choice's selection pool: the batch (B*T tokens) instead of a sequence
    "expert_choice_batch": RouterConfig("expert_choice", {"capacity_factor": 2.0, "group": "batch"}),
    # Expert Threshold's one-factor controls (issue 54): fixed top-2 (loss-free bias balancing, ET's
    # weights: the softmax over all experts, unrenormalised); ET's weights renormalised over its chosen
    "topk_lossfree_unnorm": RouterConfig(
        "topk", {"top_k": 2, "aux_loss_coef": 0.0, "balance_rate": 1e-3, "normalize": False}
    ),
    "expert_threshold_renorm": RouterConfig(
        "ec_threshold", {"capacity_factor": 2.0, "statistic": "population", "aux_loss_coef": 0.0, "normalize": True}
    ),
}
"""Label -> router configuration: every configuration the built-in suites (:data:`USES`) and the
router study run, in one place; each suite reads its rows in this order."""


def router_configs(use: str) -> list[tuple[str, dict]]:
    """(router name, options) of every row of :data:`ROUTER_TABLE` that ``use`` (one of
    :data:`USES`) runs, in table order; each options dict a fresh copy."""
    if use not in USES:
        raise ValueError(f"use must be one of {', '.join(USES)}, got {use!r}")
    return [(c.router, dict(c.options)) for c in ROUTER_TABLE.values() if use in c.uses]


def list_routers() -> list[str]:
    """Names accepted by :func:`build_router`."""
    return sorted(registered_routers())


def build_router(name: str, *, d_model: int, num_experts: int, **options) -> Router:
    """Build a registered router: ``build_router("topk", d_model=512, num_experts=8, top_k=2)``."""
    known = registered_routers()
    if name not in known:
        raise ValueError(f"unknown router {name!r}; known routers: {', '.join(sorted(known))}")
    unknown = sorted(set(options) - set(router_options(known[name])))
    if unknown:
        raise ValueError(
            f"bad options for router {name!r}: no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(router_options(known[name]))}"
        )
    try:
        return known[name](d_model, num_experts, **options)
    except TypeError as e:
        raise ValueError(f"bad options for router {name!r}: {e}") from None


def router_options(cls: type[Router]) -> list[str]:
    """The keyword options a router class takes: its ``__init__``'s and, where that passes
    ``**base`` on, its bases' (up to ``Router``'s), in that order."""
    names = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        named = (p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        names += [n for n in named if n not in ("self", "d_model", "num_experts", *names)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return names


__all__ = [
    "ROUTER_TABLE",
    "RouterConfig",
    "build_router",
    "list_routers",
    "router_configs",
    "CapacityRouter",
    "DocumentPoolRouter",
    "ExpertChoicePredictorRouter",
    "ExpertChoiceBase",
    "ExpertChoiceRouter",
    "ExpertChoiceThresholdRouter",
    "GlobalQuantileBalancingRouter",
    "HashRouter",
    "QuantileBalancingRouter",
    "ReLURouter",
    "SeqTopKRouter",
    "SinkhornRouter",
    "TokenChoiceBase",
    "TokenRoundingRouter",
    "TopKRouter",
    "TopPRouter",
]
