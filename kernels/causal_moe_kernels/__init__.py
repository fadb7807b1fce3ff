"""Dispatch / grouped-matmul / combine for MoE layers: PyTorch references and Triton kernels.

This package knows tensors and indices, never routers: it imports nothing from ``moe``.
The references import only torch; the Triton side (``moe_ffn_triton``, ``routing_metadata``,
``dispatch``, ``combine``, ``grouped_mm``) is imported on first use, so ``import causal_moe_kernels``
never imports triton.
"""

from importlib import import_module

from causal_moe_kernels.reference import (
    gather_rows,
    moe_ffn_reference,
    scatter_sum,
    sort_by_expert,
    token_slots,
)

_LAZY = {
    "moe_ffn_triton": "causal_moe_kernels.moe_ffn",
    "routing_metadata": "causal_moe_kernels.metadata",
    "RoutingMeta": "causal_moe_kernels.metadata",
    "dispatch": "causal_moe_kernels.dispatch_combine",
    "combine": "causal_moe_kernels.dispatch_combine",
    "grouped_mm": "causal_moe_kernels.grouped_mm",
}

__all__ = ["gather_rows", "moe_ffn_reference", "scatter_sum", "sort_by_expert", "token_slots", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
