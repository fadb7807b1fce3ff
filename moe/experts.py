"""Stacked bias-free SwiGLU experts and the backends that run them.

Shape legend: N tokens, D model width, F expert width, E experts, A assignments.

Two storage layouts, one computation: :class:`SwiGLUExperts` owns ``w_gate``, ``w_up``
``[E, D, F]`` and ``w_down`` ``[E, F, D]``; :class:`FusedSwiGLUExperts` computes from the
layout Hugging Face transformers 5.x uses (``gate_up_proj`` ``[E, 2F, D]``, ``down_proj``
``[E, D, F]``) through strided views, so it can share another model's parameters without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from causal_moe_kernels.launch import TRITON_MISSING, triton_installed
from causal_moe_kernels.reference import moe_ffn_reference
from moe.checks import positive_int

MoEFFN = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD) -> y_ND"""

BACKENDS: dict[str, Callable[[], MoEFFN]] = {
    "torch": lambda: moe_ffn_reference,
    "triton": lambda: __import__("causal_moe_kernels.moe_ffn", fromlist=["moe_ffn_triton"]).moe_ffn_triton,
    "grouped_mm": lambda: _grouped_mm_backend(),
}
"""Backend name -> loader of its function (loaded lazily, so no backend is imported early)."""

CUDA_AUTO = "grouped_mm"
"""What ``backend="auto"`` runs on CUDA: PyTorch's grouped GEMM, until a GPU run of
``experiments/gpu_check.sh`` shows the Triton kernels equal to it and faster (docs/kernels.md
holds the rule and the evidence; no GPU has run them yet)."""


def _grouped_mm_backend() -> MoEFFN:
    # an import statement, not __import__: torch.compile traces it (the module is loaded by then)
    from causal_moe_kernels.torch_grouped import moe_ffn_grouped_mm

    return moe_ffn_grouped_mm


def check_backend(name: str) -> None:
    """ValueError for a backend name that is unknown, or that needs triton where it is not installed."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))} and 'auto'")
    if name == "triton" and not triton_installed():
        raise ValueError(f"backend 'triton': {TRITON_MISSING}")


def resolve_backend(name: str, device: torch.device | None = None) -> MoEFFN:
    if name == "auto":
        name = CUDA_AUTO if device is not None and device.type == "cuda" else "torch"
    check_backend(name)
    return BACKENDS[name]()


class SwiGLUExperts(nn.Module):
    """E experts y = (silu(x W_gate) * (x W_up)) W_down, weights stacked as [E, D, F] / [E, F, D]."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("d_model", d_model), ("d_ff", d_ff)):
            positive_int(name, v)
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_up, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(self.d_ff))

    def forward(
        self, x_ND: Tensor, token_A: Tensor, expert_A: Tensor, weight_A: Tensor, backend: str = "torch"
    ) -> Tensor:
        fn = resolve_backend(backend, x_ND.device)
        return fn(x_ND, token_A, expert_A, weight_A, self.w_gate, self.w_up, self.w_down)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}"


class FusedSwiGLUExperts(nn.Module):
    """The SwiGLU experts of :class:`SwiGLUExperts`, stored output-major with gate and up fused:
    ``gate_up_proj`` [E, 2F, D] (rows 0..F-1 the gate, F..2F-1 the up projection) and
    ``down_proj`` [E, D, F], i.e. ``y = (silu(x gate^T) * (x up^T)) down^T``.

    Built around existing parameters (e.g. a Hugging Face model's ``experts.gate_up_proj`` and
    ``experts.down_proj``), which it registers as its own: the two modules then share storage.
    ``w_gate``, ``w_up`` [E, D, F] and ``w_down`` [E, F, D] are strided views of them, which both
    backends compute with directly (no weight is copied).
    """

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter) -> None:
        super().__init__()
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
            raise ValueError(
                f"expected gate_up_proj [E, 2F, D] and down_proj [E, D, F], got {tuple(gate_up_proj.shape)} "
                f"and {tuple(down_proj.shape)}"
            )
        e, two_f, d = gate_up_proj.shape
        if tuple(down_proj.shape) != (e, d, two_f // 2):
            raise ValueError(f"down_proj must be [E, D, F] = {(e, d, two_f // 2)}, got {tuple(down_proj.shape)}")
        self.num_experts, self.d_model, self.d_ff = e, d, two_f // 2
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    @property
    def w_gate(self) -> Tensor:
        return self.gate_up_proj[:, : self.d_ff].transpose(1, 2)

    @property
    def w_up(self) -> Tensor:
        return self.gate_up_proj[:, self.d_ff :].transpose(1, 2)

    @property
    def w_down(self) -> Tensor:
        return self.down_proj.transpose(1, 2)

    def forward(
        self, x_ND: Tensor, token_A: Tensor, expert_A: Tensor, weight_A: Tensor, backend: str = "torch"
    ) -> Tensor:
        fn = resolve_backend(backend, x_ND.device)
        return fn(x_ND, token_A, expert_A, weight_A, self.w_gate, self.w_up, self.w_down)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, layout=fused"
