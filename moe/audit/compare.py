"""How the outputs of two forwards are compared: per compared position, the largest change of a
float output relative to the scale of its entry (:func:`entry_scale`) and the changed exact
decisions (routing, integer outputs), for one copy or for every copy of a packed forward at once.

Shape legend: B batch, T sequence (S: the compared positions), F output features per position,
X exact decisions per position, P copies in one packed forward.

NaN and inf are compared as values: a position whose NaN / inf pattern changes counts as a flip;
where both are NaN (or the same inf) nothing changed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moe.audit.target import Outputs

ULPS_32, ULPS_16 = 100, 4
"""Least tolerance, in units of the output dtype's eps times the scale of the compared entry: fp32
/ fp64 outputs carry the accumulation-order differences of a changed batch or length (a few dozen
ulp at most for the widths audited); 16-bit outputs are rounded from fp32 accumulators, which
hides those differences but for one or two ulps."""


def resolution_of(dtype: torch.dtype | None) -> float:
    """The least relative change that counts: ulps of the dtype's eps (0 without float outputs)."""
    if dtype is None:
        return 0.0
    return (ULPS_16 if torch.finfo(dtype).bits <= 16 else ULPS_32) * torch.finfo(dtype).eps


def entry_scale(a_BSF: Tensor, b_BSF: Tensor, row_max: bool = False) -> Tensor:
    """The scale a change of each entry is measured against: the larger of |before|, |after| and
    the median |entry| of its output row (so a near-zero entry is judged at its row's scale, and
    a massive activation raises the scale of its own entry only). ``row_max``: the row's largest
    |entry| instead of its median, but at least the median of every row's largest |entry| (a
    router's weights: mostly zeros, each judged against the largest weight of its token; a token
    whose every weight is small, as a ReLU gate just above zero, is judged at a typical token's:
    the rounding of its weights comes from logits of the usual size). NaN / inf count as 0. Any
    leading axes broadcast; the row is the last axis (one output's features)."""
    a, b = a_BSF.nan_to_num(0.0, 0.0, 0.0).abs(), b_BSF.nan_to_num(0.0, 0.0, 0.0).abs()
    if not a.shape[-1] or not a.numel():
        return torch.maximum(a, b)
    if row_max:
        row = a.amax(dim=-1, keepdim=True)
        row = row.clamp_min(row.flatten().median())
    else:
        row = a.median(dim=-1, keepdim=True).values
    return torch.maximum(torch.maximum(a, b), row)


Tolerance = float | Mapping[str, float]
"""A relative tolerance: one for every float output, or one per output name (:class:`~moe.audit.target.Part`)."""


def _tol(tolerance: Tolerance, name: str) -> float:
    return tolerance if isinstance(tolerance, (int, float)) else tolerance[name]


@dataclass
class Diff:
    """Per compared copy P and position S: the largest change between values finite in both
    (float64 [P, S]); changed exact decisions plus entries whose NaN / inf pattern changed
    (int64 [P, S]); the largest change over tolerance x its entry's scale (float64 [P, S]; above
    1 it counts); and per output (:class:`~moe.audit.target.Part`, by name) its largest excess
    and its flips in each copy (float64 [P], int64 [P]). ``same``: no compared value differed
    at all in any copy (the other fields are zeros)."""

    delta_PS: Tensor
    flips_PS: Tensor
    excess_PS: Tensor
    by_part: dict[str, tuple[Tensor, Tensor]]
    same: bool = False
    exact_entries_P: Tensor | None = None
    """int64 [P]: exact entries (routing decisions, integer / bool values) compared in each copy."""
    exact_changed_P: Tensor | None = None
    """int64 [P]: how many of them changed."""

    @functools.cached_property
    def moved_PS(self) -> Tensor:
        return (self.excess_PS > 1) | (self.flips_PS > 0)

    def moved_parts(self, p: int) -> list[str]:
        """The outputs that moved in copy p."""
        return [name for name, (e_P, f_P) in self.by_part.items() if e_P[p] > 1 or f_P[p] > 0]


def compare(
    ref: Outputs,
    outs: Outputs,
    copies: int,
    upto_P: list[int],
    rows: tuple[int, ...] | None = None,
    tolerance: Tolerance = 1.0,
    ref_rows: tuple[int, ...] | None = None,
) -> Diff:
    """Compare ``ref`` (B samples) with each of the ``copies`` consecutive B-sample copies in
    ``outs`` at positions s < upto_P[p] of the samples ``rows`` (None: all), read in ``ref`` at
    ``ref_rows`` (None: the same indices). Positions at or after a copy's ``upto`` count nothing.
    Exact outputs are compared where both forwards have them with the same width (a prefix may
    make fewer router calls)."""
    s = max(upto_P)
    delta_PS = torch.zeros(copies, s, dtype=torch.float64)
    flips_PS = torch.zeros(copies, s, dtype=torch.long)
    excess_PS = torch.zeros(copies, s, dtype=torch.float64)
    by_part: dict[str, tuple[Tensor, Tensor]] = {}
    live_PS = torch.arange(s)[None, :] < torch.tensor(upto_P)[:, None]
    pick = slice(None) if rows is None else list(rows)
    ref_pick = pick if ref_rows is None else list(ref_rows)

    def shaped(x: Tensor) -> Tensor:  # [copies * B, T, W] -> [copies, B', S, W]
        x = x.reshape(copies, -1, *x.shape[1:])[:, pick, :s]
        return x

    out_parts = {p.name: p for p in outs.parts}
    identical = True
    exact_entries_P = torch.zeros(copies, dtype=torch.long)
    exact_changed_P = torch.zeros(copies, dtype=torch.long)
    for part in ref.parts:
        other = out_parts.get(part.name)
        if other is None or other.exact != part.exact or other.stop - other.start != part.stop - part.start:
            continue
        ref_all, out_all = (ref.exact_BTX, outs.exact_BTX) if part.exact else (ref.value_BTF, outs.value_BTF)
        if ref_all is None or out_all is None:
            continue
        a = ref_all[ref_pick, :s, part.start : part.stop][None]
        b = shaped(out_all[..., other.start : other.stop])
        live_P1S1 = live_PS.to(a.device)[:, None, :, None]
        if part.exact:
            exact_entries_P += live_PS.sum(1) * a.shape[1] * a.shape[3]
        if not bool(((a != b) & live_P1S1).any()):  # the usual case for a causal target: nothing moved
            by_part[part.name] = (torch.zeros(copies, dtype=torch.float64), torch.zeros(copies, dtype=torch.long))
            continue
        identical = False
        if part.exact:
            f_PS = ((a != b) & live_P1S1).sum(dim=(1, 3)).cpu()
            flips_PS += f_PS
            exact_changed_P += f_PS.sum(1)
            by_part[part.name] = (torch.zeros(copies, dtype=torch.float64), f_PS.sum(1))
            continue
        both = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        change = torch.where(both & live_P1S1, a - b, 0.0).abs()
        d_PS = change.amax(dim=(1, 3)).cpu()
        limit = (_tol(tolerance, part.name) * entry_scale(a, b, part.weights)).clamp_min(
            torch.finfo(torch.float64).tiny
        )
        e_PS = (change / limit).amax(dim=(1, 3)).cpu()
        f_PS = (~both & ~same & live_P1S1).sum(dim=(1, 3)).cpu()
        delta_PS = torch.maximum(delta_PS, d_PS)
        excess_PS = torch.maximum(excess_PS, e_PS)
        flips_PS += f_PS
        by_part[part.name] = (e_PS.amax(1), f_PS.sum(1))
    return Diff(delta_PS, flips_PS, excess_PS, by_part, identical, exact_entries_P, exact_changed_P)


def difference(
    ref: Outputs, out: Outputs, upto: int, rows: tuple[int, ...] | None, tolerance: Tolerance = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`compare` for one copy: per position s < upto, over the samples ``rows`` (None:
    all), the largest change (float64 [S]), the flips (int64 [S]) and the largest change over
    tolerance x its entry's scale (float64 [S]; with tolerance 1, the largest relative change)."""
    d = compare(ref, out, 1, [upto], rows, tolerance)
    return d.delta_PS[0], d.flips_PS[0], d.excess_PS[0]


def part_floors(ref: Outputs, out: Outputs, t: int) -> dict[str, float]:
    """Per float output: the largest relative change between two forwards of the same input."""
    by_part = compare(ref, out, 1, [t]).by_part
    return {p.name: float(by_part[p.name][0][0]) if p.name in by_part else 0.0 for p in ref.float_parts}
