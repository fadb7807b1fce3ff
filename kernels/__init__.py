"""Dispatch / grouped-matmul / combine for MoE layers: PyTorch references and Triton kernels.

This package knows tensors and indices, never routers: it imports nothing from ``moe``.
The references import only torch; the Triton side (``moe_ffn_triton``, ``routing_metadata``,
``dispatch``, ``combine``, ``grouped_mm``) is imported on first use, so ``import kernels``
never imports triton.
"""

from importlib import import_module

from kernels.reference import (
    gather_rows,
    moe_ffn_reference,
    scatter_sum,
    sort_by_expert,
    token_slots,
)

_LAZY = {
    "moe_ffn_triton": "kernels.moe_ffn",
    "routing_metadata": "kernels.metadata",
    "RoutingMeta": "kernels.metadata",
    "dispatch": "kernels.dispatch_combine",
    "combine": "kernels.dispatch_combine",
    "grouped_mm": "kernels.grouped_mm",
}

__all__ = ["gather_rows", "moe_ffn_reference", "scatter_sum", "sort_by_expert", "token_slots", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
