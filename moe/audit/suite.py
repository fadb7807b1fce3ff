"""The built-in audit suite: every router under each option set that changes its claims,
alone, inside an MoELayer, and inside the ``tiny`` model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moe.layer import MoELayer
from moe.model import MoETransformer, preset
from moe.routers import build_router

BATCH, SEQ, D_MODEL, D_FF, EXPERTS = 4, 16, 32, 64, 4
"""Shapes of the router / layer targets; the model targets use the ``tiny`` preset at T = SEQ."""

ROUTER_CONFIGS: list[tuple[str, dict]] = [
    ("topk", {"top_k": 2}),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "sequence"}),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "batch"}),
    (
        "capacity",
        {"top_k": 2, "capacity_factor": 1.0, "priority": "position", "group": "sequence", "capacity_scope": "prefix"},
    ),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "score", "group": "sequence"}),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "score", "group": "batch"}),
    ("capacity", {"top_k": 2, "capacity_factor": 1.0, "priority": "choice", "group": "sequence"}),
    ("expert_choice", {"capacity_factor": 1.0, "group": "sequence"}),
    ("expert_choice", {"capacity_factor": 1.0, "group": "batch"}),
    ("ec_threshold", {"capacity_factor": 1.0}),
    ("ec_threshold", {"capacity_factor": 1.0, "statistic": "population", "score": "sigmoid", "aux_loss_coef": 0.0}),
    ("ec_predictor", {"capacity_factor": 1.0}),
    ("remoe", {"top_k": 2}),
    ("top_p", {"target_experts": 2}),
    ("topk", {"top_k": 2, "null_experts": 4}),
    ("quantile", {"top_k": 2}),
    ("seq_topk", {"top_k": 2}),
]
"""(router name, options): each option set that changes causality or batch invariance.
Capacity factor 1.0 makes capacity bind at these small shapes."""


@dataclass
class BuiltinTarget:
    name: str
    """e.g. "layer capacity(score,batch)"."""
    build: Callable[[], nn.Module]
    example: Callable[[], Tensor]


def config_label(router: str, options: dict) -> str:
    keys = [k for k in ("priority", "group", "capacity_scope", "statistic") if k in options]
    words = [str(options[k]) for k in keys] + ([f"null={options['null_experts']}"] if "null_experts" in options else [])
    return f"{router}({','.join(words)})" if words else router


def builtin_targets(seed: int = 0) -> list[BuiltinTarget]:
    """Router, MoELayer and tiny model for every entry of :data:`ROUTER_CONFIGS`, built
    deterministically from ``seed``."""
    targets = []
    for kind in ("router", "layer", "model"):
        for router, options in ROUTER_CONFIGS:
            targets.append(_target(kind, router, options, seed))
    return targets


def _target(kind: str, router: str, options: dict, seed: int) -> BuiltinTarget:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        if kind == "router":
            return build_router(router, d_model=D_MODEL, num_experts=EXPERTS, **options)
        if kind == "layer":
            return MoELayer(D_MODEL, D_FF, EXPERTS, router=router, **options)
        return MoETransformer(preset("tiny", router=router, router_options=dict(options)))

    def example() -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        if kind == "model":
            return torch.randint(0, preset("tiny").vocab_size, (BATCH, SEQ), generator=gen)
        return torch.randn(BATCH, SEQ, D_MODEL, generator=gen)

    return BuiltinTarget(f"{kind} {config_label(router, options)}", build, example)
