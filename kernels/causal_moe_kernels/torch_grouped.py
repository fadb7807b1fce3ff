"""The MoE feed-forward on PyTorch's own grouped GEMM, ``torch._grouped_mm``: ``moe_ffn_grouped_mm``,
a drop-in for ``causal_moe_kernels.reference.moe_ffn_reference`` (the ``"grouped_mm"`` backend of ``moe.MoELayer``).

Shape legend: N tokens, D model width, F expert width, E experts, A assignments,
P = A rows in expert-sorted order.

Forward (three grouped GEMMs, 2-D rows x 3-D stacked weights, one group per expert):

    order_A, offs_E = stable sort of the assignments by expert; offs_E[e] = rows of experts <= e
    gate, up        = x[token_P] @ w_gate, x[token_P] @ w_up                 [P, F]
    rows            = (silu(gate) * up) @ w_down                             [P, D]
    y[n]            = sum of weight[p] * rows[p] over n's rows, fp32, in row order

Backward (five grouped GEMMs; the weight gradients are 2-D x 2-D, one K-slice per expert):

    drows, dweight  = weight[p] * dy[token_P],  <rows[p], dy[token_P]>
    dh              = drows @ w_down^T;  du = dh * silu(gate);  dgate = silu'(gate) * dh * up
    dw_down         = h^T drows;  dw_gate = x[token_P]^T dgate;  dw_up = x[token_P]^T du
    dx[n]           = sum over n's rows of dgate @ w_gate^T + du @ w_up^T, fp32, in row order

What ``torch._grouped_mm`` requires (the same in torch 2.11, the GPU image's, and 2.13) and how it
is met here:

* int32 offsets whose last entry is P: rows past it would be left unwritten (``offs_E`` comes
  from ``searchsorted`` with ``out_int32``, with no host read);
* each operand's two inner dimensions row- or column-major, the other stride a multiple of 16
  bytes, and on CUDA a 16-byte-aligned data pointer: :func:`aligned` passes tensors that qualify
  and copies any other into a padded buffer (widths that are not a multiple of 16 bytes: 4 fp32
  or 8 bf16 elements; odd test shapes, not the presets);
* a gradient with real strides: its own backward rejects the stride-0 gradient of ``y.sum()``.
  The backward here is written out and every grouped GEMM gets gathered rows (contiguous);
* float32, bfloat16 or float16 (no float64: a ValueError) and no autocast of its own: under
  autocast x and the weights are cast to its dtype first, as the Triton backend does;
* empty experts are zero-size groups: their weight gradients are zeros (on CPU here, and by
  the grouped GEMM's own CUDA tests on sm_90; torch issue 172439 reports sm_100 getting it wrong).

The whole computation is one opaque operator with its backward operator
(``torch.ops.causal_moe_kernels.grouped_mm_moe_ffn``), eager and under ``torch.compile`` alike: the
grouped GEMM's fake-tensor rule accepts only bfloat16 (torch 2.11 and 2.13), so an fp32 layer
could not be traced through it, and inside an operator the per-token sums stay the ones below
instead of inductor's atomic scatter. The operator's output shapes are known from its inputs.

Deterministic: the per-token sums are ``index_put_(..., accumulate=True)`` into an fp32 buffer,
serial on CPU and on CUDA always PyTorch's sort-based kernel (``_index_put_impl_`` in
aten/src/ATen/native/TensorAdvancedIndexing.cpp sends every accumulating index_put there), which
adds each destination's rows in a fixed order; no host read. The grouped GEMMs give each output
element one reduction; ``experiments/gpu_check.sh`` reruns the layer on a GPU and compares bitwise.

Peers that run their experts this way: torchtitan's ``_run_experts_grouped_mm``
(torchtitan/models/common/moe.py, since folded into ``GroupedExperts.forward``) and transformers'
``grouped_mm_experts_forward`` (src/transformers/integrations/moe.py), both through autograd's
own backward of the grouped GEMM, bf16 under compile, and combining a fixed top-k per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from causal_moe_kernels.ffn_inputs import check_ffn_shapes, one_dtype
from causal_moe_kernels.reference import (
    backward_through,
    combine_backward,
    input_gradients_fake,
    save_inputs_and_extras,
)

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What ``torch._grouped_mm`` multiplies."""


def moe_ffn_grouped_mm(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> Tensor:
    """y[n] = sum over assignments a of token n: weight[a] * SwiGLU_{expert[a]}(x[n]).

    Same contract as ``moe_ffn_reference`` (expert ids in [0, E); tokens with no assignment get
    zeros), in float32, bfloat16 or float16: x and the expert weights share one dtype, or
    autocast is on and both are cast to its dtype. Weights of any strides (transposed views of
    a transformers model's fused tensors included).
    """
    if not hasattr(torch, "_grouped_mm"):
        raise ValueError(f"backend 'grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} lacks")
    check_ffn_shapes(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD)
    x_ND, w_gate_EDF, w_up_EDF, w_down_EFD = one_dtype(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD)
    if x_ND.dtype not in GROUPED_MM_DTYPES:
        raise ValueError(
            f"backend 'grouped_mm' computes in float32, bfloat16 or float16 (torch._grouped_mm), got {x_ND.dtype}; "
            "use backend='torch' for it"
        )
    if token_A.numel() == 0:
        return x_ND.new_zeros(x_ND.shape[0], w_down_EFD.shape[-1])
    return torch.ops.causal_moe_kernels.grouped_mm_moe_ffn(
        x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD
    )[0]


def aligned(t: Tensor) -> Tensor:
    """``t`` if ``torch._grouped_mm`` takes it as it is (its two inner dimensions row- or
    column-major, the other stride a multiple of 16 bytes, the data 16-byte aligned), else a copy
    whose rows are padded to a multiple of 16 bytes (same values and shape, other strides)."""
    align = 16 // t.element_size()
    *_, m, n = t.shape
    *_, sm, sn = t.stride()
    row_major = sn == 1 and sm >= max(1, n) and sm % align == 0
    column_major = sm == 1 and sn >= max(1, m) and sn % align == 0
    if (row_major or column_major) and t.data_ptr() % 16 == 0:
        return t
    padded = t.new_empty(*t.shape[:-1], -(-n // align) * align)[..., :n]
    return padded.copy_(t)


def _layout(token_A: Tensor, expert_A: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order_A, token_P, offs_E): the stable sort by expert, each row's token, and the int32
    end offset of each expert's rows (empty experts repeat the previous offset)."""
    expert_P, order_A = torch.sort(expert_A, stable=True)
    experts_E = torch.arange(num_experts, device=expert_A.device, dtype=expert_P.dtype)
    offs_E = torch.searchsorted(expert_P, experts_E, right=True, out_int32=True)
    return order_A, token_A[order_A], offs_E


def _sum_rows(rows_PD: Tensor, token_P: Tensor, num_tokens: int, dtype: torch.dtype) -> Tensor:
    """[N, D] in ``dtype``: each token's rows summed in fp32 in row order (deterministic, see module doc)."""
    sums_ND = rows_PD.new_zeros(num_tokens, rows_PD.shape[1], dtype=torch.float32)
    return sums_ND.index_put_((token_P,), rows_PD.float(), accumulate=True).to(dtype)


@torch.library.custom_op("causal_moe_kernels::grouped_mm_moe_ffn", mutates_args=())
def _grouped_ffn_op(
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y_ND, x_PD, gate_PF, up_PF, rows_PD, order_A, offs_E): y and what its backward needs."""
    order_A, token_P, offs_E = _layout(token_A, expert_A, w_gate_EDF.shape[0])
    x_PD = aligned(x_ND.index_select(0, token_P))
    gate_PF = torch._grouped_mm(x_PD, aligned(w_gate_EDF), offs=offs_E)
    up_PF = torch._grouped_mm(x_PD, aligned(w_up_EDF), offs=offs_E)
    rows_PD = torch._grouped_mm(aligned(F.silu(gate_PF) * up_PF), aligned(w_down_EFD), offs=offs_E)
    weighted_PD = rows_PD.float() * weight_A[order_A].float().unsqueeze(-1)
    y_ND = _sum_rows(weighted_PD, token_P, x_ND.shape[0], x_ND.dtype)
    saved = (x_PD, gate_PF, up_PF, rows_PD)
    return y_ND, *(t.contiguous() for t in saved), order_A, offs_E


@_grouped_ffn_op.register_fake
def _grouped_ffn_fake(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD):
    a, (e, d, f) = token_A.shape[0], w_gate_EDF.shape
    return (
        x_ND.new_empty(x_ND.shape[0], d),
        x_ND.new_empty(a, d),
        x_ND.new_empty(a, f),
        x_ND.new_empty(a, f),
        x_ND.new_empty(a, d),
        token_A.new_empty(a),
        token_A.new_empty(e, dtype=torch.int32),
    )


@torch.library.custom_op("causal_moe_kernels::grouped_mm_moe_ffn_backward", mutates_args=())
def _grouped_ffn_backward_op(
    grad_ND: Tensor,
    x_ND: Tensor,
    token_A: Tensor,
    expert_A: Tensor,
    weight_A: Tensor,
    w_gate_EDF: Tensor,
    w_up_EDF: Tensor,
    w_down_EFD: Tensor,
    x_PD: Tensor,
    gate_PF: Tensor,
    up_PF: Tensor,
    rows_PD: Tensor,
    order_A: Tensor,
    offs_E: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of y w.r.t. (x, weight, w_gate, w_up, w_down), every matmul a grouped GEMM."""
    token_P = token_A[order_A]
    grad_rows_PD, grad_weight_P = combine_backward(grad_ND, rows_PD, weight_A[order_A], token_P)
    drows_PD, x_PD = aligned(grad_rows_PD), aligned(x_PD)
    dh_PF = torch._grouped_mm(drows_PD, aligned(w_down_EFD).transpose(1, 2), offs=offs_E)
    silu_PF = F.silu(gate_PF)
    du_PF = aligned(dh_PF * silu_PF)
    dgate_PF = aligned(torch.ops.aten.silu_backward(dh_PF * up_PF, gate_PF))
    dw_down = torch._grouped_mm(aligned(silu_PF * up_PF).T, drows_PD, offs=offs_E)
    dw_gate = torch._grouped_mm(x_PD.T, dgate_PF, offs=offs_E)
    dw_up = torch._grouped_mm(x_PD.T, du_PF, offs=offs_E)
    dx_PD = torch._grouped_mm(dgate_PF, aligned(w_gate_EDF).transpose(1, 2), offs=offs_E)
    dx_PD = dx_PD + torch._grouped_mm(du_PF, aligned(w_up_EDF).transpose(1, 2), offs=offs_E)
    grad_weight_A = torch.empty_like(grad_weight_P)
    grad_weight_A[order_A] = grad_weight_P
    grad_x_ND = _sum_rows(dx_PD, token_P, x_ND.shape[0], x_ND.dtype)
    return grad_x_ND, grad_weight_A, dw_gate.contiguous(), dw_up.contiguous(), dw_down.contiguous()


GROUPED_FFN_OP = torch.ops.causal_moe_kernels.grouped_mm_moe_ffn.default
"""The forward operator (its outputs hold the grouped GEMMs' products: what selective activation
checkpointing keeps, ``moe.parallel.recompute``)."""

_grouped_ffn_backward_op.register_fake(input_gradients_fake)
_grouped_ffn_op.register_autograd(
    backward_through(torch.ops.causal_moe_kernels.grouped_mm_moe_ffn_backward), setup_context=save_inputs_and_extras
)
