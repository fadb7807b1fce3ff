"""Built-in routers; importing this package registers them by name."""

from moe.routers.capacity import CapacityRouter
from moe.routers.ec_predictor import ExpertChoicePredictorRouter
from moe.routers.ec_threshold import ExpertChoiceThresholdRouter
from moe.routers.expert_choice import ExpertChoiceRouter
from moe.routers.token_choice import TokenChoiceBase, TopKRouter

__all__ = [
    "CapacityRouter",
    "ExpertChoicePredictorRouter",
    "ExpertChoiceRouter",
    "ExpertChoiceThresholdRouter",
    "TokenChoiceBase",
    "TopKRouter",
]
