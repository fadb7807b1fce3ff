"""The checks and the dtype rule every fused MoE feed-forward of this package applies to its inputs.

Shape legend: N tokens, D model width, F expert width, E experts, A assignments.

Shared by the Triton backend (``causal_moe_kernels.moe_ffn``) and the grouped-GEMM backend
(``causal_moe_kernels.torch_grouped``); imports only torch, so the grouped backend never imports triton.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_ffn_shapes(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD) -> None:
    """ValueError naming the first inconsistent shape among the MoE FFN arguments."""
    if x_ND.dim() != 2:
        raise ValueError(f"x_ND must be [N, D], got {tuple(x_ND.shape)}")
    if w_gate_EDF.dim() != 3 or w_gate_EDF.shape != w_up_EDF.shape:
        raise ValueError(
            f"w_gate_EDF and w_up_EDF must both be [E, D, F], got {tuple(w_gate_EDF.shape)} and {tuple(w_up_EDF.shape)}"
        )
    e, d, f = w_gate_EDF.shape
    if x_ND.shape[1] != d:
        raise ValueError(f"x_ND has width {x_ND.shape[1]} but the experts expect D={d}")
    if tuple(w_down_EFD.shape) != (e, f, d):
        raise ValueError(f"w_down_EFD must be [E, F, D] = {(e, f, d)}, got {tuple(w_down_EFD.shape)}")
    if weight_A.dim() != 1 or weight_A.shape != token_A.shape:
        raise ValueError(f"weight_A must be 1-D like token_A {tuple(token_A.shape)}, got {tuple(weight_A.shape)}")


def one_dtype(x_ND: Tensor, *w_EXY: Tensor) -> tuple[Tensor, ...]:
    """(x, *weights) in one dtype: under autocast all cast to its dtype (differentiably, so fp32
    master weights get their gradients); otherwise they must already share one (ValueError)."""
    device_type = x_ND.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in (x_ND, *w_EXY))
    dtypes = {t.dtype for t in (x_ND, *w_EXY)}
    if len(dtypes) > 1:
        raise ValueError(
            f"x and the expert weights must share one dtype (or run under autocast), got {sorted(map(str, dtypes))}"
        )
    return (x_ND, *w_EXY)
