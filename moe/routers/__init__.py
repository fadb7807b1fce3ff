"""Built-in routers; importing this package registers them by name, and builds any registered
router by name (``build_router``)."""

import inspect

from moe.routers.capacity import CapacityRouter
from moe.routers.doc_pool import DocumentPoolRouter
from moe.routers.ec_predictor import ExpertChoicePredictorRouter
from moe.routers.ec_threshold import ExpertChoiceThresholdRouter
from moe.routers.expert_choice import ExpertChoiceRouter
from moe.routers.hash import HashRouter
from moe.routers.quantile import QuantileBalancingRouter
from moe.routers.quantile_global import GlobalQuantileBalancingRouter
from moe.routers.remoe import ReLURouter
from moe.routers.seq_topk import SeqTopKRouter
from moe.routers.token_choice import TokenChoiceBase, TopKRouter
from moe.routers.token_rounding import TokenRoundingRouter
from moe.routers.top_p import TopPRouter
from moe.routing import Router, registered_routers


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
    "build_router",
    "list_routers",
    "CapacityRouter",
    "DocumentPoolRouter",
    "ExpertChoicePredictorRouter",
    "ExpertChoiceRouter",
    "ExpertChoiceThresholdRouter",
    "GlobalQuantileBalancingRouter",
    "HashRouter",
    "QuantileBalancingRouter",
    "ReLURouter",
    "SeqTopKRouter",
    "TokenChoiceBase",
    "TokenRoundingRouter",
    "TopKRouter",
    "TopPRouter",
]
