"""Built-in routers; importing this package registers them by name, and builds any registered
router by name (``build_router``)."""

from moe.routers.capacity import CapacityRouter
from moe.routers.ec_predictor import ExpertChoicePredictorRouter
from moe.routers.ec_threshold import ExpertChoiceThresholdRouter
from moe.routers.expert_choice import ExpertChoiceRouter
from moe.routers.hash import HashRouter
from moe.routers.quantile import QuantileBalancingRouter
from moe.routers.quantile_global import GlobalQuantileBalancingRouter
from moe.routers.remoe import ReLURouter
from moe.routers.seq_topk import SeqTopKRouter
from moe.routers.token_choice import TokenChoiceBase, TopKRouter
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
    try:
        return known[name](d_model, num_experts, **options)
    except TypeError as e:
        raise ValueError(f"bad options for router {name!r}: {e}") from None


__all__ = [
    "build_router",
    "list_routers",
    "CapacityRouter",
    "ExpertChoicePredictorRouter",
    "ExpertChoiceRouter",
    "ExpertChoiceThresholdRouter",
    "GlobalQuantileBalancingRouter",
    "HashRouter",
    "QuantileBalancingRouter",
    "ReLURouter",
    "SeqTopKRouter",
    "TokenChoiceBase",
    "TopKRouter",
    "TopPRouter",
]
