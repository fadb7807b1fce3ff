"""The built-in audit suite: every router under each option set that changes its claims,
alone, inside an MoELayer, and inside the ``tiny`` model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moe.layer import MoELayer
from moe.model import MoETransformer, preset
from moe.routers import build_router, router_configs

BATCH, SEQ, D_MODEL, D_FF, EXPERTS = 4, 16, 32, 64, 4
"""Shapes of the router / layer targets; the model targets use the ``tiny`` preset at T = SEQ."""

ROUTER_CONFIGS: list[tuple[str, dict]] = router_configs("audit")
"""(router name, options): each option set that changes causality or batch invariance (the
rows of ``moe.routers.ROUTER_TABLE`` used by "audit")."""


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
