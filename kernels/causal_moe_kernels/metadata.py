"""Routing metadata on the device: a stable counting sort of assignments by expert.

Shape legend: N tokens, E experts, A assignments, P = A positions in expert-sorted order,
NB blocks of assignments, BLOCK_E = E rounded up to a power of two.

Three kernels, no atomics, no host synchronisation:

1. histogram: each block of assignments counts its experts -> hist [NB, BLOCK_E];
2. prefix sum: one program scans hist over blocks (each block's base per expert) and over
   experts (per-expert offsets);
3. scatter: each assignment's sorted position = offset of its expert + base of its block +
   its rank among the block's assignments of that expert. Ties keep assignment order, so
   the sort is stable and equal to ``torch.argsort(expert_A, stable=True)``.

The scatter also fills ``pos_NE``: the sorted position of the row of (token n, expert e), or
-1. It is each token's list of rows, in expert order: combine and the backward of dispatch
read it to sum a token's rows in a fixed order without atomics. It requires the assignments
to be distinct (token, expert) pairs, which every router of the package produces;
:func:`routing_metadata` checks it (asynchronously on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from causal_moe_kernels.launch import Kernel, next_pow2
from causal_moe_kernels.reference import sort_by_expert


@dataclass
class RoutingMeta:
    """Where each assignment goes, computed once per forward and shared by every kernel."""

    perm_P: Tensor
    """int32 [A]: the assignment index at each expert-sorted position."""
    token_P: Tensor
    """int32 [A]: the token of each expert-sorted position (the dispatch gather index)."""
    counts_E: Tensor
    """int32 [E]: assignments per expert."""
    offsets_E: Tensor
    """int32 [E + 1]: first sorted position of each expert; offsets_E[E] = A."""
    pos_NE: Tensor
    """int32 [N, E]: sorted position of the (token, expert) row, -1 where not routed."""

    @property
    def num_tokens(self) -> int:
        return self.pos_NE.shape[0]

    @property
    def num_experts(self) -> int:
        return self.pos_NE.shape[1]

    @property
    def num_assignments(self) -> int:
        return self.perm_P.numel()


def _histogram_kernel(expert_ptr, hist_ptr, A, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(expert_ptr + offs, mask=offs < A, other=-1)
    ecols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == ecols[None, :]).to(tl.int32)
    tl.store(hist_ptr + pid * BLOCK_E + ecols, tl.sum(onehot, axis=0))


def _prefix_kernel(hist_ptr, base_ptr, counts_ptr, offsets_ptr, NB, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, NB, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        m = (rows < NB)[:, None]
        offs = rows[:, None] * BLOCK_E + ecols[None, :]
        h = tl.load(hist_ptr + offs, mask=m, other=0)
        tl.store(base_ptr + offs, tl.cumsum(h, axis=0) - h + running[None, :], mask=m)
        running += tl.sum(h, axis=0)
    em = ecols < E
    tl.store(counts_ptr + ecols, running, mask=em)
    tl.store(offsets_ptr + ecols, tl.cumsum(running, axis=0) - running, mask=em)
    tl.store(offsets_ptr + E, tl.sum(running, axis=0))


def _scatter_kernel(
    expert_ptr,
    token_ptr,
    base_ptr,
    offsets_ptr,
    perm_ptr,
    token_sorted_ptr,
    pos_ptr,
    A,
    E,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < A
    e = tl.load(expert_ptr + offs, mask=valid, other=-1)
    t = tl.load(token_ptr + offs, mask=valid, other=0)
    ecols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == ecols[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, axis=0) - onehot
    first = tl.load(base_ptr + pid * BLOCK_E + ecols) + tl.load(offsets_ptr + ecols, mask=ecols < E, other=0)
    pos = tl.sum(onehot * (rank + first[None, :]), axis=1)
    tl.store(perm_ptr + pos, offs, mask=valid)
    tl.store(token_sorted_ptr + pos, t, mask=valid)
    tl.store(pos_ptr + t.to(tl.int64) * E + e, pos, mask=valid)


_histogram = Kernel(_histogram_kernel)
_prefix = Kernel(_prefix_kernel)
_scatter = Kernel(_scatter_kernel)


def _sort_block(num_experts: int) -> tuple[int, int]:
    """(BLOCK, BLOCK_E): about 16K one-hot entries per program."""
    block_e = max(2, next_pow2(num_experts))
    return max(64, 16384 // block_e), block_e


def check_assignments(token_A: Tensor, expert_A: Tensor, num_tokens: int, num_experts: int) -> None:
    """ValueError unless token_A / expert_A are equal-length 1-D integer tensors in range."""
    for name, t in (("token_A", token_A), ("expert_A", expert_A)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if token_A.shape != expert_A.shape:
        raise ValueError(f"token_A {tuple(token_A.shape)} and expert_A {tuple(expert_A.shape)} differ in length")
    if num_tokens * max(num_experts, 1) >= 2**31:
        raise ValueError(f"N*E = {num_tokens}*{num_experts} does not fit int32 positions")


def routing_metadata(
    token_A: Tensor, expert_A: Tensor, num_tokens: int, num_experts: int, block: int | None = None
) -> RoutingMeta:
    """Stable counting sort of the assignments by expert (three Triton kernels, see module doc).

    ``block``: assignments per program (a power of two; default about 16K / E). Out-of-range
    indices and repeated (token, expert) pairs raise ValueError on CPU; on CUDA they trip an
    asynchronous device assertion instead of a host synchronisation.
    """
    check_assignments(token_A, expert_A, num_tokens, num_experts)
    dev = token_A.device
    a = token_A.numel()
    default_block, block_e = _sort_block(num_experts)
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block}")
    block = block or default_block
    nb = max(1, triton.cdiv(a, block))
    i32 = dict(dtype=torch.int32, device=dev)
    hist = torch.empty(nb, block_e, **i32)
    base = torch.empty(nb, block_e, **i32)
    counts_E = torch.empty(num_experts, **i32)
    offsets_E = torch.empty(num_experts + 1, **i32)
    perm_P = torch.empty(a, **i32)
    token_P = torch.empty(a, **i32)
    pos_NE = torch.full((num_tokens, num_experts), -1, **i32)
    _histogram[(nb,), dev](expert_A, hist, a, BLOCK=block, BLOCK_E=block_e)
    _prefix[(1,), dev](hist, base, counts_E, offsets_E, nb, num_experts, CHUNK=64, BLOCK_E=block_e)
    _scatter[(nb,), dev](
        expert_A, token_A, base, offsets_E, perm_P, token_P, pos_NE, a, num_experts, BLOCK=block, BLOCK_E=block_e
    )
    _check_valid(token_A, expert_A, pos_NE, num_tokens, num_experts)
    return RoutingMeta(perm_P=perm_P, token_P=token_P, counts_E=counts_E, offsets_E=offsets_E, pos_NE=pos_NE)


def _check_valid(token_A: Tensor, expert_A: Tensor, pos_NE: Tensor, num_tokens: int, num_experts: int) -> None:
    if token_A.numel() == 0:
        return
    in_range = (
        (token_A.min() >= 0) & (token_A.max() < num_tokens) & (expert_A.min() >= 0) & (expert_A.max() < num_experts)
    )
    distinct = (pos_NE >= 0).sum() == token_A.numel()
    msg = (
        f"assignments must have tokens in [0, {num_tokens}), experts in [0, {num_experts}) "
        "and no repeated (token, expert) pair"
    )
    if token_A.is_cuda:
        torch._assert_async(in_range & distinct, msg)
    elif not bool(in_range & distinct):
        raise ValueError(msg)


def routing_metadata_reference(token_A: Tensor, expert_A: Tensor, num_tokens: int, num_experts: int) -> RoutingMeta:
    """The same metadata from torch ops (stable argsort, bincount, cumsum)."""
    check_assignments(token_A, expert_A, num_tokens, num_experts)
    order_A, counts_E = sort_by_expert(expert_A, num_experts)
    offsets_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=token_A.device)
    offsets_E[1:] = torch.cumsum(counts_E, 0)
    pos_NE = torch.full((num_tokens, num_experts), -1, dtype=torch.int32, device=token_A.device)
    pos_NE[token_A[order_A], expert_A[order_A]] = torch.arange(
        order_A.numel(), dtype=torch.int32, device=token_A.device
    )
    return RoutingMeta(
        perm_P=order_A.int(),
        token_P=token_A[order_A].int(),
        counts_E=counts_E.int(),
        offsets_E=offsets_E.int(),
        pos_NE=pos_NE,
    )
