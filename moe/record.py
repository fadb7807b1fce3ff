"""A recorded routing: which experts every MoE layer gave each token, in the layout that
inference engines return, so that a training forward can route with it (``moe.replay_routing``).

Shape legend: B sequences, S positions, L MoE layers (the model's routers in module order),
K slots per (token, layer), T positions of one forward, N = B*T.

The layout is int32 ``[B, S, L, K]``; one sequence's ``[S, L, K]`` is ``[tokens, layers, top_k]``,
what vLLM (``enable_return_routed_experts``, PR #28284) and SGLang (``return_routed_experts``)
return per request for Rollout Routing Replay (R3, arXiv 2510.11370). Padding: -1 marks an
empty slot. A router that gives each token exactly K experts (top-k, quantile) fills every slot;
one whose tokens get a varying number (capacity drops, null experts, expert choice, thresholds,
top-p, ReMoE, SeqTopK) fills the first slots of each (token, layer) and pads with -1, K being
the most experts one token got in the record; a token that got no expert has only -1. Only
experts that served a token are recorded (not a choice that a capacity dropped, not a null
expert). Within a (token, layer) the experts keep the routing's order (top-k and quantile:
decreasing score; the others: increasing expert index). Size: 4 * L * K bytes per token
(:attr:`RoutingRecord.bytes_per_token`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from moe.routing import Routing, count_indices


class RoutingRecord:
    """Each token's experts in each MoE layer: :attr:`experts`, int32 [B, S, L, K] (-1 = empty slot).

    Filled by ``moe.record_routing`` (a forward without a decode state routes positions
    0..T-1 of its B sequences, a decoded chunk the next T positions; a position routed twice
    keeps the later routing), or built from arrays: :meth:`from_engine`, :meth:`load`.
    """

    def __init__(
        self,
        num_layers: int,
        experts_BSLK: Tensor | None = None,
        num_experts: list[int] | None = None,
        padding: Tensor | None = None,
    ) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"a routing record needs at least one MoE layer, got num_layers={num_layers!r}")
        if num_experts is not None and len(num_experts) != num_layers:
            raise ValueError(f"num_experts names {len(num_experts)} MoE layers, the record holds {num_layers}")
        self.num_layers = num_layers
        self.num_experts = None if num_experts is None else [int(e) for e in num_experts]
        """Experts of each MoE layer of the model that made the record (None: not known, e.g. an
        engine's array); ``replay_routing`` refuses a model with other numbers."""
        self.padding = padding
        """bool [B, S] or None: positions that are padding (no token; no recorded expert), e.g. of a
        left-padded batch (``moe.engine_records.left_padded``)."""
        self._chunks: list[list[tuple[int, Tensor]]] = [[] for _ in range(num_layers)]
        """Per layer: (first position, int32 [B, T, K]) of each recorded forward, in order."""
        self._filled = [0] * num_layers
        """Per layer: positions 0.._filled-1 are recorded."""
        self._experts: Tensor | None = None
        if experts_BSLK is not None:
            checked = _checked_array(experts_BSLK, "experts")
            if checked.dim() != 4 or checked.shape[2] != num_layers:
                raise ValueError(f"expected experts of shape [B, S, L={num_layers}, K], got {tuple(checked.shape)}")
            for layer in range(num_layers):
                self.write(layer, checked[:, :, layer].reshape(-1, checked.shape[3]), checked.shape[:2], 0)

    # -- the assembled record ---------------------------------------------------------------
    @property
    def experts(self) -> Tensor:
        """int32 [B, S, L, K]: the recorded experts (see the module docstring); ValueError while
        nothing or not every layer's positions were recorded."""
        if self._experts is None:
            self._experts = self._assemble()
        return self._experts

    @property
    def batch_size(self) -> int:
        return self.experts.shape[0]

    @property
    def length(self) -> int:
        """S: positions recorded per sequence."""
        return self.experts.shape[1]

    @property
    def slots(self) -> int:
        """K: expert slots per (token, layer)."""
        return self.experts.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """What one token's routing costs to keep: 4 bytes (int32) x L layers x K slots."""
        return 4 * self.num_layers * self.slots

    def rows(self, start: int, stop: int) -> RoutingRecord:
        """The record of sequences start..stop-1 (e.g. one microbatch's, or one rank's)."""
        padding = None if self.padding is None else self.padding[start:stop]
        return RoutingRecord(self.num_layers, self.experts[start:stop], self.num_experts, padding)

    def __repr__(self) -> str:
        if not any(self._chunks):
            return f"RoutingRecord(num_layers={self.num_layers}, empty)"
        b, s, layers, k = self.experts.shape
        return (
            f"RoutingRecord(sequences={b}, positions={s}, layers={layers}, slots={k}, {self.bytes_per_token} B/token)"
        )

    # -- engines and files ------------------------------------------------------------------
    def to_engine(self) -> list[np.ndarray]:
        """Per sequence, int32 [S, L, K] = [tokens, layers, top_k] (-1 padding), as engines return."""
        return [row.cpu().numpy() for row in self.experts]

    @classmethod
    def from_engine(cls, arrays, num_experts: list[int] | None = None) -> RoutingRecord:
        """A record from what an engine returned: a list of per-sequence [tokens, layers, top_k]
        integer arrays of equal shape (numpy or torch; -1 = empty slot), one such array, or one
        [B, tokens, layers, top_k] array. Sequences of different lengths are replayed one at a
        time (a forward routes B sequences of one length). ``num_experts``: each layer's experts
        in the model that served them, if known (checked on replay)."""
        if isinstance(arrays, (np.ndarray, Tensor)) and arrays.ndim == 3:
            arrays = [arrays]
        if isinstance(arrays, (np.ndarray, Tensor)) and arrays.ndim == 4:
            stacked = _checked_array(arrays, "the engine's array")
        else:
            rows = [_checked_array(a, f"sequence {i}") for i, a in enumerate(arrays)]
            if not rows or any(r.dim() != 3 for r in rows):
                raise ValueError("expected [tokens, layers, top_k] arrays, one per sequence")
            if len({tuple(r.shape) for r in rows}) > 1:
                raise ValueError(
                    f"sequences of different shapes {sorted({tuple(r.shape) for r in rows})}: a forward routes "
                    "sequences of one length together, so build one record per length"
                )
            stacked = torch.stack(rows)
        if stacked.dim() != 4:
            raise ValueError(f"expected [B, tokens, layers, top_k], got shape {tuple(stacked.shape)}")
        return cls(stacked.shape[2], stacked, num_experts)

    def save(self, path: str | Path) -> None:
        """Write an ``.npz`` of the per-sequence [tokens, layers, top_k] int32 arrays (``seq0``,
        ``seq1``, ...; numpy reads it without this package), with ``num_sequences`` (their number) and,
        when known, ``num_experts`` (int32 [L]), by which :meth:`load` and ``replay_routing`` check
        the file, and ``padding`` (bool [B, S]) where positions are padding."""
        extra = {"num_sequences": np.int64(self.batch_size)}
        if self.num_experts is not None:
            extra["num_experts"] = np.asarray(self.num_experts, dtype=np.int32)
        if self.padding is not None:
            extra["padding"] = self.padding.cpu().numpy()
        np.savez(Path(path), **{f"seq{b}": a for b, a in enumerate(self.to_engine())}, **extra)

    @classmethod
    def load(cls, path: str | Path) -> RoutingRecord:
        """A record from :meth:`save`'s ``.npz``, or from an ``.npy`` holding one engine array
        ([tokens, layers, top_k], or [B, tokens, layers, top_k]). ValueError naming the file if it
        is missing, empty, truncated or not such a record, or if a sequence is missing from it."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no routing record at {path}")
        try:
            loaded = np.load(path)
            arrays = loaded if isinstance(loaded, np.ndarray) else {n: loaded[n] for n in loaded.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path} is not a readable routing record (empty or truncated?): {e}") from None
        try:
            return cls._from_file_arrays(arrays)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def _from_file_arrays(cls, arrays) -> RoutingRecord:
        if isinstance(arrays, np.ndarray):
            return cls.from_engine(arrays)
        names = [n for n in arrays if n not in ("num_sequences", "num_experts", "padding")]
        if not names or any(not (n.startswith("seq") and n[3:].isdigit()) for n in names):
            raise ValueError(f"it holds {sorted(arrays)}, not the seq0, seq1, ... arrays RoutingRecord.save writes")
        count = int(arrays["num_sequences"]) if "num_sequences" in arrays else len(names)
        missing = sorted(set(range(count)) - {int(n[3:]) for n in names})
        if missing or len(names) != count:
            found = ", ".join(sorted(names, key=lambda n: int(n[3:])))
            raise ValueError(f"a sequence is missing: it should hold seq0..seq{count - 1}, it holds {found}")
        num_experts = arrays["num_experts"].tolist() if "num_experts" in arrays else None
        record = cls.from_engine([arrays[f"seq{i}"] for i in range(count)], num_experts)
        record.padding = torch.as_tensor(arrays["padding"]) if "padding" in arrays else None
        return record

    # -- recording and replaying (moe.replay) -----------------------------------------------
    def write(self, layer: int, expert_NK: Tensor, batch_shape: tuple[int, int], position: int) -> None:
        """Record one forward of layer ``layer``: the slots of its N = B*T tokens (int [N, K]),
        which are positions ``position..position+T-1`` of the B sequences."""
        b, t = batch_shape
        if self._chunks[layer] and self._chunks[layer][0][1].shape[0] != b:
            raise ValueError(
                f"a routing record follows one batch of sequences: it holds {self._chunks[layer][0][1].shape[0]}, "
                f"a forward routed {b} (record each batch in its own record_routing)"
            )
        if position > self._filled[layer]:
            raise ValueError(
                f"MoE layer {layer} routed positions {position}.. but the record holds only 0..{self._filled[layer] - 1}: "
                "a record follows its sequences from position 0 (record the prompt's forward too)"
            )
        self._chunks[layer].append((position, expert_NK.view(b, t, -1).to(torch.int32)))
        self._filled[layer] = max(self._filled[layer], position + t)
        self._experts = None

    def choices(self, layer: int, batch_shape: tuple[int, int], position: int) -> Tensor:
        """int64 [B*T, K]: layer ``layer``'s recorded experts of positions position..position+T-1."""
        b, t = batch_shape
        experts = self.experts
        if b != experts.shape[0] or position + t > experts.shape[1]:
            raise ValueError(
                f"the routing record holds {experts.shape[0]} sequences of {experts.shape[1]} positions; a forward "
                f"routes {b} sequences at positions {position}..{position + t - 1}"
            )
        return experts[:, position : position + t, layer].reshape(b * t, -1).long()

    def _assemble(self) -> Tensor:
        if not any(self._chunks):
            raise ValueError("the routing record is empty: no MoE layer routed inside record_routing")
        if len(set(self._filled)) > 1:
            raise ValueError(
                f"the MoE layers recorded different numbers of positions ({self._filled}): an incomplete record"
            )
        first = self._chunks[0][0][1]
        k = max(chunk.shape[2] for chunks in self._chunks for _, chunk in chunks)
        out = torch.full((first.shape[0], self._filled[0], self.num_layers, k), -1, dtype=torch.int32)
        out = out.to(first.device)
        for layer, chunks in enumerate(self._chunks):
            for position, chunk in chunks:  # in order: a position routed twice keeps the later routing
                out[:, position : position + chunk.shape[1], layer, : chunk.shape[2]] = chunk
                out[:, position : position + chunk.shape[1], layer, chunk.shape[2] :] = -1
        return out


def routing_slots(routing: Routing) -> Tensor:
    """int64 [N, K]: each token's experts in the order of its kept assignments, -1 in the slots
    it does not fill; K = the most experts one token got (at least 1, read on the host): the
    form a record keeps and ``Router.replay`` takes."""
    kept = routing.compact()
    count_N = count_indices(kept.token, routing.num_tokens)
    order_A = torch.argsort(kept.token, stable=True)
    token_A = kept.token[order_A]
    slot_A = torch.arange(token_A.numel(), device=token_A.device) - (count_N.cumsum(0) - count_N)[token_A]
    k = max(int(count_N.max()), 1) if routing.num_tokens else 1
    expert_NK = torch.full((routing.num_tokens, k), -1, dtype=torch.long, device=token_A.device)
    expert_NK[token_A, slot_A] = kept.expert[order_A]
    return expert_NK


def _checked_array(a, what: str) -> Tensor:
    """An integer array as int32 (values >= -1); ValueError otherwise."""
    t = torch.as_tensor(a)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what}: expert ids must be integers, got {t.dtype}")
    if t.numel() and int(t.min()) < -1:
        raise ValueError(f"{what}: expert ids must be >= 0, or -1 for an empty slot; got {int(t.min())}")
    return t.to(torch.int32)
