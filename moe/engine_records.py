"""Routing records to and from the layouts inference engines and Hugging Face return.

Shape legend: B sequences, S positions, L MoE layers, K slots (top_k), N = B*S.

==================================  ====================================  ===========================
layout                              shape, dtype                          bytes per token
==================================  ====================================  ===========================
this package (``RoutingRecord``)    int32 [B, S, L, K], -1 = empty slot   4 * L * K (32 for the study's
                                                                          baby model: L 4, K 2)
vLLM ``routed_experts``, SGLang     per request [seq_len - 1, L, K]       4 * L * K as int32, 2 * L * K
``return_routed_experts``,          integers (the last generated token    as int16 (verl stores int16);
TensorRT-LLM's R3 proposal          is never forwarded: it has no row)    1,536 as int32 for a
                                                                          Qwen3-30B-A3B shape (48 x 8)
SGLang with                         [seq_len - 1 - start, L, K]: rows     as above, for the rows returned
``routed_experts_start_len=start``  start..seq_len-2 only
SGLang's HTTP response              ``meta_info["routed_experts"]``: the  4 * ceil(n / 3) characters for
(``meta_info["routed_experts"]``)   base64 text of the int32 array        n = 4 * L * K * rows bytes:
                                    above, flat (row, layer, slot         about 5.33 * L * K per token
                                    order), native little-endian          (43 for the baby model;
                                                                          2,048 for Qwen3-30B-A3B)
Hugging Face ``MoERouting``         ``selected_experts``: a tuple of L    8 * L * K (int64)
(transformers PR #44925)            int64 [B*S, K] (row b*S + s)
==================================  ====================================  ===========================

SGLang's response carries neither the number of layers nor top_k: :func:`from_sglang_base64` is
told them (the served model's) and refuses text whose byte count they do not divide.

``MoERouting`` is not in transformers 5.24 (the version tested here); :func:`to_hf_routing` builds
it when ``transformers.modeling_outputs.MoERouting`` exists and returns the bare tuple of
``selected_experts`` otherwise; :func:`from_hf_routing` reads either, or a dict keyed by layer.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import torch
from torch import Tensor

from moe.checks import positive_int
from moe.record import RoutingRecord


def from_engine_request(
    routed_experts,
    seq_len: int,
    start: int = 0,
    prefix: RoutingRecord | None = None,
    num_experts: list[int] | None = None,
) -> RoutingRecord:
    """The record of one request from an engine's ``routed_experts`` [seq_len - 1 - start, L, K]
    (``start``: SGLang's ``routed_experts_start_len``; 0 for vLLM, TensorRT-LLM). Positions
    0..start-1 come from ``prefix``, the record of a forward that routed them (the prompt's, or a
    cached prefix's); ValueError when rows are missing or extra, naming the contract."""
    rows_SLK = torch.as_tensor(np.asarray(routed_experts))
    want = seq_len - 1 - start
    if rows_SLK.dim() != 3 or rows_SLK.shape[0] != want:
        raise ValueError(
            f"an engine returns [seq_len - 1 - start, layers, top_k] = [{want}, L, K] rows for seq_len={seq_len}, "
            f"start={start} (the last token has no routed row); got shape {tuple(rows_SLK.shape)}"
        )
    if start == 0:
        return RoutingRecord.from_engine(rows_SLK, num_experts)
    if prefix is None or prefix.length < start:
        held = "none" if prefix is None else f"{prefix.length} positions"
        raise ValueError(
            f"routed_experts start at position {start}: positions 0..{start - 1} need the record of the forward "
            f"that routed them (prefix=, a one-sequence record; given: {held})"
        )
    head_SLK = prefix.experts[0, :start].cpu()
    k = max(head_SLK.shape[-1], rows_SLK.shape[-1])
    parts = [torch.nn.functional.pad(p.to(torch.int32), (0, k - p.shape[-1]), value=-1) for p in (head_SLK, rows_SLK)]
    return RoutingRecord.from_engine(torch.cat(parts), num_experts or prefix.num_experts)


def to_engine_requests(record: RoutingRecord, start: int = 0, dtype=np.int32) -> list[np.ndarray]:
    """Per sequence, the engine layout [S - start, L, K] (a record of a generation of seq_len
    tokens holds S = seq_len - 1 positions, as the engines do) in ``dtype`` (int16 fits E < 32768)."""
    if np.iinfo(dtype).max < int(record.experts.max()):
        raise ValueError(f"expert ids up to {int(record.experts.max())} do not fit {np.dtype(dtype).name}")
    return [row[start:].cpu().numpy().astype(dtype) for row in record.experts]


def to_sglang_base64(record: RoutingRecord, start: int = 0) -> list[str]:
    """Per sequence, the text SGLang returns in ``meta_info["routed_experts"]``: the base64 of its
    int32 little-endian [S - start, L, K] rows (:func:`to_engine_requests`)."""
    return [
        base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii") for rows in to_engine_requests(record, start)
    ]


def from_sglang_base64(
    text: str | bytes,
    seq_len: int,
    num_layers: int,
    top_k: int,
    start: int = 0,
    prefix: RoutingRecord | None = None,
    num_experts: list[int] | None = None,
) -> RoutingRecord:
    """The record of one request from SGLang's ``meta_info["routed_experts"]`` (base64 of int32
    [seq_len - 1 - start, L, K], ``num_layers`` = L and ``top_k`` = K of the served model), read
    as :func:`from_engine_request` reads the array; ValueError in one line naming what is wrong
    (not base64, a byte count that is not whole rows of L * K int32, the wrong number of rows)."""
    positive_int("num_layers", num_layers)
    positive_int("top_k", top_k)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"SGLang routed_experts is not base64 text ({e})") from None
    row_bytes = 4 * num_layers * top_k
    if len(raw) % row_bytes:
        raise ValueError(
            f"SGLang routed_experts holds {len(raw)} bytes, not whole rows of {num_layers} layers x top_k {top_k} "
            f"int32 ({row_bytes} bytes): wrong num_layers / top_k for this model?"
        )
    rows_SLK = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k).copy()  # writable, for torch
    return from_engine_request(rows_SLK, seq_len, start, prefix, num_experts)


def left_padded(requests: list, length: int, num_experts: list[int] | None = None) -> RoutingRecord:
    """One record of B requests of different lengths laid out as a left-padded batch of
    ``length`` positions (the prompt right-aligned, as a left-padding trainer lays out its token
    ids): request b's row t lands at position ``length - len_b + t``; padding positions have no
    recorded expert and are marked in :attr:`RoutingRecord.padding`."""
    rows = [torch.as_tensor(np.asarray(r)).to(torch.int32) for r in requests]
    if not rows or any(r.dim() != 3 or r.shape[1:2] != rows[0].shape[1:2] for r in rows):
        raise ValueError("expected one [tokens, layers, top_k] array per request, with the same number of layers")
    if max(r.shape[0] for r in rows) > length:
        raise ValueError(f"a request of {max(r.shape[0] for r in rows)} rows does not fit {length} positions")
    k = max(r.shape[2] for r in rows)
    experts_BSLK = torch.full((len(rows), length, rows[0].shape[1], k), -1, dtype=torch.int32)
    padding_BS = torch.ones(len(rows), length, dtype=torch.bool)
    for b, r in enumerate(rows):
        experts_BSLK[b, length - r.shape[0] :, :, : r.shape[2]] = r
        padding_BS[b, length - r.shape[0] :] = False
    return RoutingRecord(experts_BSLK.shape[2], experts_BSLK, num_experts, padding=padding_BS)


def to_hf_routing(record: RoutingRecord):
    """Hugging Face's ``MoERouting(selected_experts=...)``: per layer int64 [B*S, K] (the bare tuple
    where transformers has no ``MoERouting``)."""
    selected = tuple(record.experts[:, :, layer].reshape(-1, record.slots).long() for layer in range(record.num_layers))
    try:
        from transformers.modeling_outputs import MoERouting
    except ImportError:
        return selected
    return MoERouting(selected_experts=selected)


def from_hf_routing(routing, batch_size: int, num_experts: list[int] | None = None) -> RoutingRecord:
    """A record from Hugging Face's ``MoERouting``, its ``selected_experts`` tuple, or a dict keyed
    by layer index, each int [B*S, K] (row b*S + s) for ``batch_size`` = B sequences."""
    selected = getattr(routing, "selected_experts", routing)
    if isinstance(selected, dict):
        if sorted(selected) != list(range(len(selected))):
            raise ValueError(f"a routing dict must be keyed by layers 0..L-1, got {sorted(selected)}")
        selected = [selected[layer] for layer in range(len(selected))]
    layers: list[Tensor] = [torch.as_tensor(s) for s in selected]
    if not layers or any(t.dim() != 2 or t.shape != layers[0].shape for t in layers):
        raise ValueError("selected_experts must hold one [batch * seq_len, top_k] tensor per layer, all of one shape")
    if layers[0].shape[0] % batch_size:
        raise ValueError(f"{layers[0].shape[0]} routed rows do not divide into batch_size={batch_size} sequences")
    stacked_NLK = torch.stack(layers, 1)
    return RoutingRecord.from_engine(stacked_NLK.view(batch_size, -1, *stacked_NLK.shape[1:]), num_experts)
