"""Exact mode: a forward whose every row is computed the same way whoever shares its batch, so
that training, decoding one token at a time, a sequence alone or in a batch, and a prompt
prefilled whole or in chunks give the same logits and routing bit for bit.

Shape legend: M rows of a matmul, K its reduced width, N its output width, R = :data:`ROW_BLOCK`,
Tq queries, S keys, C = :data:`KEY_BLOCK`, Dh head width.

    with moe.exact_mode():
        logits_BTV = model(idx_BT).logits      # equals, bit for bit, the cached decoding's

What breaks bitwise equality on CPU (measured, torch 2.13, ``experiments/bench_exact.py``): a
GEMM's row depends on how many rows the GEMM gets (fp32, 1 thread: 1-3 rows take another
kernel; 2 threads: also 5-7 and 9-11), so a decoded token (B rows) and the same token in a
teacher-forced forward (B*T rows) differ in the last bits; attention through
``scaled_dot_product_attention`` differs between a causal forward and a cached step with a mask
(fp32 5e-7, bf16 8e-3 on the scores' scale). RMSNorm, softmax over experts and the elementwise
ops are row-independent, and the combine of the data path already sums each token's rows in
expert order (``causal_moe_kernels.reference``).

Inside :func:`exact_mode` a ``TorchFunctionMode`` computes instead:

* every matmul (``F.linear``, ``@``, ``torch.matmul``) in blocks of R = 32 rows, each block one
  GEMM of the same shape (``torch.bmm``; the last block zero-padded), so a row's result depends
  on that row alone (on 1 thread the values equal the plain GEMM's);
* attention explicitly: scores, softmax and the weighted sum over keys in blocks of C = 64 keys,
  the queries in blocks of 16, keys past the last block padded and masked; a block of masked keys
  adds exact zeros, so a query's result does not depend on how many later keys the call held;
* ``torch.topk`` by a stable sort: ties go to the lower index (expert index for routers);
* the ``grouped_mm`` backend with each expert's rows padded to a multiple of R by zero-weight
  rows of a zero token, so every group GEMM gets a multiple of R rows.

What stays batch-dependent by definition: aux losses and statistics of the batch (deterministic
run to run, not per sequence), and routers whose choice of a token reads other tokens; such a
router says so with an :class:`ExactnessWarning` when it routes in exact mode (expert choice,
capacity by score or over the batch, SeqTopK), as does the ``triton`` backend.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 32
"""R: rows per GEMM in exact mode (16 costs 1.35x on the study's [768, 128] x [128, 384] GEMM, 32
1.09x; a decoded batch of B < R rows is padded to R)."""
KEY_BLOCK = 64
"""C: keys per attention block in exact mode."""
QUERY_BLOCK = 16
"""Queries per attention GEMM in exact mode (a decoded step's one query is padded to it: 64
made decoding 2.4x the normal path at the study's shape)."""

_depth = 0
"""How many :func:`exact_mode` blocks are open (the mode's own state, read by :func:`exact_active`)."""


class ExactnessWarning(UserWarning):
    """A path that cannot be exact ran inside :func:`exact_mode`."""


def exact_active() -> bool:
    """Whether an :func:`exact_mode` block is open."""
    return _depth > 0


def warn_inexact(what: str, why: str) -> None:
    """Say that ``what`` cannot be exact (once per message and place)."""
    if exact_active():
        warnings.warn(f"exact mode: {what} cannot be exact: {why}", ExactnessWarning, stacklevel=3)


@contextmanager
def exact_mode() -> Iterator[None]:
    """Compute every forward inside the block in exact mode (see the module docstring)."""
    global _depth
    _depth += 1
    try:
        with _ExactFunctions():
            yield
    finally:
        _depth -= 1


def blocked_matmul(a_MK: Tensor, b_KN: Tensor, rows: int | None = None) -> Tensor:
    """``a @ b`` for a [..., M, K] and b [K, N] or [..., K, N], each ``rows`` (default R) rows of
    a one GEMM of the same shape (batched by ``torch.bmm``), so a row's result does not depend
    on M."""
    rows = ROW_BLOCK if rows is None else rows
    *lead, m, k = a_MK.shape
    n = b_KN.shape[-1]
    if b_KN.dim() == 2:
        a_PK = _pad_rows(a_MK.reshape(-1, k), rows)
        blocks = a_PK.shape[0] // rows
        out_PN = torch.bmm(a_PK.view(blocks, rows, k), b_KN.unsqueeze(0).expand(blocks, k, n))
        return out_PN.view(-1, n)[: a_MK.numel() // k].view(*lead, m, n)
    batch = torch.broadcast_shapes(tuple(lead), tuple(b_KN.shape[:-2]))
    a_GMK = _pad_rows(a_MK.expand(*batch, m, k), rows).reshape(-1, rows, k)
    per_batch = -(-m // rows)
    b_GKN = b_KN.expand(*batch, k, n).reshape(-1, k, n)
    if per_batch > 1:
        b_GKN = b_GKN.unsqueeze(1).expand(-1, per_batch, k, n).reshape(-1, k, n)
    return torch.bmm(a_GMK, b_GKN).view(*batch, -1, n)[..., :m, :]


def _pad_rows(a_MK: Tensor, rows: int) -> Tensor:
    """a with zero rows appended up to a multiple of ``rows``."""
    pad = -a_MK.shape[-2] % rows
    return F.pad(a_MK, (0, 0, 0, pad)) if pad else a_MK


def blocked_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` by :func:`blocked_matmul`."""
    y = blocked_matmul(x, weight.t())
    return y if bias is None else y + bias


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` computed in blocks of C keys (fp32 for lower
    precisions), each query's result independent of the other queries and of later masked keys."""
    if dropout_p:
        warn_inexact("attention with dropout", "its dropout draws depend on the batch")
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    tq, s = q.shape[-2], k.shape[-2]
    allowed = torch.ones(tq, s, dtype=torch.bool, device=q.device).tril() if is_causal else attn_mask
    bias_TS = q.new_zeros((), dtype=torch.float32)
    if allowed is not None:
        bias_TS = torch.where(allowed, 0.0, float("-inf")) if allowed.dtype == torch.bool else allowed.float()
    dtype, work = q.dtype, torch.promote_types(q.dtype, torch.float32)
    pad = -s % KEY_BLOCK
    k_S, v_S = _pad_rows(k.to(work), KEY_BLOCK), _pad_rows(v.to(work), KEY_BLOCK)
    bias_TS = F.pad(bias_TS.expand(*bias_TS.shape[:-2], tq, s), (0, pad), value=float("-inf"))
    q = q.to(work) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = [  # in place where autograd allows: fewer [.., Tq, C] temporaries
        blocked_matmul(q, k_S[..., c : c + KEY_BLOCK, :].transpose(-1, -2), QUERY_BLOCK).add_(
            bias_TS[..., c : c + KEY_BLOCK]
        )
        for c in range(0, s + pad, KEY_BLOCK)
    ]
    top = functools.reduce(torch.maximum, [b.detach().amax(-1, keepdim=True) for b in scores])
    top = torch.where(torch.isinf(top), 0.0, top)  # a row with every key masked
    probs = [b.sub_(top).exp_() for b in scores]
    total = functools.reduce(torch.add, [p.sum(-1, keepdim=True) for p in probs])
    blocks = [
        blocked_matmul(p, v_S[..., c * KEY_BLOCK : (c + 1) * KEY_BLOCK, :], QUERY_BLOCK) for c, p in enumerate(probs)
    ]
    return (functools.reduce(torch.add, blocks) / total).to(dtype)


def stable_topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *, out=None):
    """``torch.topk`` whose ties go to the lower index: the first k of a stable sort."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def exact_grouped_ffn(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD):
    """The ``grouped_mm`` operator with each expert's rows padded to a multiple of R by rows of a
    zero token N of weight 0 (which add nothing to the N real tokens)."""
    n, e = x_ND.shape[0], w_gate_EDF.shape[0]
    count_E = torch.bincount(expert_A, minlength=e)
    pad_E = -count_E % ROW_BLOCK
    extra_P = torch.repeat_interleave(torch.arange(e, device=expert_A.device), pad_E)
    op = torch.ops.causal_moe_kernels.grouped_mm_moe_ffn
    y = op(
        torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])]),
        torch.cat([token_A, torch.full_like(extra_P, n)]),
        torch.cat([expert_A, extra_P]),
        torch.cat([weight_A, weight_A.new_zeros(extra_P.shape)]),
        w_gate_EDF,
        w_up_EDF,
        w_down_EFD,
    )
    return (y[0][:n], *y[1:])


class _ExactFunctions(TorchFunctionMode):
    """Routes the functions whose rows are not independent to their exact forms."""

    def __init__(self) -> None:
        super().__init__()
        self.handlers = {
            F.linear: blocked_linear,
            torch.matmul: self._matmul,
            Tensor.matmul: self._matmul,
            Tensor.__matmul__: self._matmul,
            F.scaled_dot_product_attention: exact_attention,
            torch.topk: stable_topk,
            Tensor.topk: stable_topk,
        }
        from causal_moe_kernels.torch_grouped import GROUPED_FFN_OP  # registers the operator

        self.handlers[torch.ops.causal_moe_kernels.grouped_mm_moe_ffn] = exact_grouped_ffn
        self.handlers[GROUPED_FFN_OP] = exact_grouped_ffn

    @staticmethod
    def _matmul(a: Tensor, b: Tensor, *, out=None) -> Tensor:
        if out is not None or a.dim() < 2 or b.dim() < 2:
            return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
        return blocked_matmul(a, b)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = self.handlers.get(func)
        return (handler or func)(*args, **(kwargs or {}))
