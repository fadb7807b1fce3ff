"""The metadata kernels' prefix sum over more blocks of assignments than one chunk of the scan
(64): each block's base per expert carries the counts of every earlier chunk. Against the
stable argsort reference, in the Triton interpreter on CPU."""

from __future__ import annotations

import torch
from extras import need

need("triton", "triton")

from causal_moe_kernels.metadata import routing_metadata, routing_metadata_reference  # noqa: E402


def test_metadata_over_more_blocks_than_one_scan_chunk_matches_stable_argsort():
    n, e, k, block = 70, 4, 2, 2  # A = 140 assignments: 70 blocks, the scan's chunks are 64
    gen = torch.Generator().manual_seed(3)
    token_A = torch.arange(n).repeat_interleave(k)
    expert_A = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).reshape(-1)
    got = routing_metadata(token_A, expert_A, n, e, block=block)
    ref = routing_metadata_reference(token_A, expert_A, n, e)
    for field in ("perm_P", "token_P", "counts_E", "offsets_E", "pos_NE"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
