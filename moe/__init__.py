"""Causality-safe Mixture-of-Experts routing.

import moe
router = moe.build_router("capacity", d_model=512, num_experts=8, top_k=2, capacity_factor=1.0)
layer = moe.MoELayer(512, 1024, 8, router="topk", top_k=2)
y, routing = layer(x_BTD, return_routing=True)
with moe.record_routing(model) as record: ...      # then: with moe.replay_routing(model, record): ...
with moe.exact_mode(): ...                         # decoding, batches and chunks give the same bits
"""

from moe.exact import exact_mode
from moe.layer import MoELayer, update_routers
from moe.record import RoutingRecord
from moe.replay import record_routing, replay_routing
from moe.routers import build_router, list_routers
from moe.routing import Claims, Router, Routing, register_router

__all__ = [
    "Claims",
    "MoELayer",
    "Router",
    "Routing",
    "RoutingRecord",
    "build_router",
    "exact_mode",
    "list_routers",
    "record_routing",
    "register_router",
    "replay_routing",
    "update_routers",
]
__version__ = "0.1.0"
