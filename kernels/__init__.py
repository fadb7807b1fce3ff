"""Dispatch / grouped-matmul / combine for MoE layers: PyTorch references and Triton kernels.

This package knows tensors and indices, never routers: it imports nothing from ``moe``.
"""

from kernels.reference import gather_rows, moe_ffn_reference, scatter_sum, sort_by_expert, token_slots

__all__ = ["gather_rows", "moe_ffn_reference", "scatter_sum", "sort_by_expert", "token_slots"]
