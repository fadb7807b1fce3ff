"""Stacked bias-free SwiGLU experts and the backends that run them.

Shape legend: N tokens, D model width, F expert width, E experts, A assignments.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from kernels.reference import moe_ffn_reference

MoEFFN = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD) -> y_ND"""

BACKENDS: dict[str, Callable[[], MoEFFN]] = {
    "torch": lambda: moe_ffn_reference,
    "triton": lambda: __import__("kernels.moe_ffn", fromlist=["moe_ffn_triton"]).moe_ffn_triton,
}
"""Backend name -> loader of its function (loaded lazily, so no backend is imported early)."""


def resolve_backend(name: str, device: torch.device | None = None) -> MoEFFN:
    if name == "auto":
        name = "triton" if device is not None and device.type == "cuda" and "triton" in BACKENDS else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))} and 'auto'")
    return BACKENDS[name]()


class SwiGLUExperts(nn.Module):
    """E experts y = (silu(x W_gate) * (x W_up)) W_down, weights stacked as [E, D, F] / [E, F, D]."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("d_model", d_model), ("d_ff", d_ff)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_up, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(self.d_ff))

    def forward(self, x_ND: Tensor, token_A: Tensor, expert_A: Tensor, weight_A: Tensor, backend: str = "torch") -> Tensor:
        fn = resolve_backend(backend, x_ND.device)
        return fn(x_ND, token_A, expert_A, weight_A, self.w_gate, self.w_up, self.w_down)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}"
