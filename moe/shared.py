"""Dense SwiGLU feed-forwards: the model's dense blocks and the shared experts of an MoE layer.

Shape legend: B batch, T sequence, D model width, F hidden width, S shared experts.

Shared experts (DeepSeekMoE, arXiv 2401.06066; DeepSeek-V2/V3, Qwen2/3-MoE) are experts that
every token uses beside its routed ones. S shared experts of width F are one SwiGLU of width
S*F: a SwiGLU is a sum over its hidden units, so S of them summed equal their concatenation,
which is how transformers' ``DeepseekV3MoE`` (``moe_intermediate_size * n_shared_experts``)
and torchtitan's DeepSeek-V3 (``moe_hidden_dim * num_shared_experts``) build them. Qwen2-MoE
(transformers' ``Qwen2MoeSparseMoeBlock``) and Megatron-Core (``SharedExpertMLP`` with
``moe_shared_expert_gate``, megatron/core/transformer/moe/shared_experts.py) optionally scale
the shared output per token by ``sigmoid(x . w)``, one gate vector w of width D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.checks import positive_int


class SwiGLU(nn.Module):
    """Dense bias-free SwiGLU feed-forward ``w_down(silu(w_gate x) * w_up x)``, x [..., D]."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class SharedExperts(nn.Module):
    """``num_shared`` experts of width ``d_ff`` that every token uses: one SwiGLU of width
    S*F (``ffn``), its output scaled by ``sigmoid(gate(x))`` (``gate``: a bias-free [1, D]
    linear) when ``gated``. Token-local: causal, batch-invariant and decoded with no state."""

    def __init__(self, d_model: int, d_ff: int, num_shared: int, gated: bool = False) -> None:
        super().__init__()
        for name, v in (("d_model", d_model), ("d_ff", d_ff), ("shared_experts", num_shared)):
            positive_int(name, v)
        self.num_shared, self.d_ff = num_shared, d_ff
        self.ffn = SwiGLU(d_model, num_shared * d_ff)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None

    def forward(self, x_BTD: Tensor) -> Tensor:
        y_BTD = self.ffn(x_BTD)
        if self.gate is not None:
            y_BTD = torch.sigmoid(self.gate(x_BTD)) * y_BTD
        return y_BTD

    def extra_repr(self) -> str:
        return f"shared_experts={self.num_shared}, d_ff={self.d_ff}, gated={self.gate is not None}"
