"""Calibration: from forwards of the example alone, how one mode of a target is to be judged.

Shape legend: B batch, T sequence (S: the compared positions), F output features per
position, X exact decisions per position.

:func:`calibrate` is a function of the target's behaviour on the example: it calls the target
through the runner (which seeds every call and records random draws only when asked) and
returns a frozen :class:`Calibration`; nothing is toggled on the runner or the target.

* **deterministic regime**: the target repeats itself under a fixed input shape and draws no
  random numbers that change its output. A float change beyond the tolerance (``FLOOR_FACTOR``
  times the repeat's relative noise floor, at least ``ulps`` of the output's dtype, times the
  scale of the compared entry) or any change of an exact decision counts.
* **seeded regime**: as deterministic, but the output depends on the random draws it makes
  (dropout, a sampled expert), which are the same ops of the same shapes for every input of the
  example's shape: comparisons of that shape run under one seed and are exact as above;
  comparisons across shapes (a sample alone, a prefix) cannot share noise and are judged by
  distribution.
* **distribution regime**: the target's output varies under a fixed seed and shape, or its
  random draws change shape with the data, so equal seeds do not mean equal noise; changes are
  then judged by a permutation test over several seeds (:mod:`moe.audit.comparator`).
* **stateful**: two identical forwards (buffers and generators reset) still differ and the forward
  changes the target's own attributes outside its buffers: no regime can judge it
  (:attr:`Calibration.stateful`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moe.audit.runner import Forward, Runner, TargetFailure
from moe.audit.target import Outputs

FLOOR_FACTOR = 10.0
"""Tolerance = this times the noise floor (the largest relative change between two identical forwards)."""
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
) -> Diff:
    """Compare ``ref`` (B samples) with each of the ``copies`` consecutive B-sample copies in
    ``outs`` at positions s < upto_P[p] of the samples ``rows`` (None: all). Positions at or
    after a copy's ``upto`` count nothing. Exact outputs are compared where both forwards have
    them with the same width (a prefix may make fewer router calls)."""
    s = max(upto_P)
    delta_PS = torch.zeros(copies, s, dtype=torch.float64)
    flips_PS = torch.zeros(copies, s, dtype=torch.long)
    excess_PS = torch.zeros(copies, s, dtype=torch.float64)
    by_part: dict[str, tuple[Tensor, Tensor]] = {}
    live_PS = torch.arange(s)[None, :] < torch.tensor(upto_P)[:, None]
    pick = slice(None) if rows is None else list(rows)

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
        a = ref_all[pick, :s, part.start : part.stop][None]
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


REGIMES = ("deterministic", "seeded", "distribution")
"""How a mode is judged: see the module docstring."""


@dataclass(frozen=True)
class Calibration:
    """How one mode of a target is judged, measured on the example. Tolerances are relative: a
    change counts above tolerance x the scale of its entry (:func:`entry_scale`), one tolerance
    per float output."""

    base: Forward
    """The example's forward under the audit seed (the reference of deterministic comparisons)."""
    resolutions: dict[str, float]
    """Per float output: the least relative change that counts (:func:`resolution_of` of its dtype)."""
    stochastic: bool
    """The target draws random numbers (with torch's generators) that change its output (not,
    e.g., an attention kernel with a dropout argument of 0)."""
    floors: dict[str, float]
    """Per float output: the largest relative change between two forwards of the example under
    the same seed."""
    regime: str
    """One of :data:`REGIMES`."""
    tolerances: dict[str, float]
    """Per float output: a relative change above this counts (deterministic and seeded regimes:
    FLOOR_FACTOR x its floor, at least its resolution; distribution regime: its resolution)."""
    nonfinite: int
    """Entries of the example's float outputs that are NaN or inf."""
    comparable: bool
    """The example's output has something to compare: an exact decision or a finite value."""
    seconds: float = 0.0
    """The fastest forward of the example in this mode (the unit of the audit's cost)."""
    stateful: str | None = None
    """Why the mode cannot be judged: two identical forwards differ and the forward changes the
    target's attributes outside its buffers (None: not so)."""
    updated_buffers: tuple[str, ...] = ()
    """Buffers the example's forward changed (restored before every forward: no leak by itself)."""

    @property
    def tolerance(self) -> float:
        """The largest of the per-output tolerances (what the report prints)."""
        return max(self.tolerances.values(), default=0.0)

    @property
    def floor(self) -> float:
        return max(self.floors.values(), default=0.0)

    def by_distribution(self) -> Calibration:
        """The same measurements judged by distribution (for a target found to draw
        data-dependent noise midway)."""
        return dataclasses.replace(self, regime="distribution", tolerances=dict(self.resolutions))


def calibrate(runner: Runner, x: Tensor, probes_x: Iterable[Tensor] = ()) -> Calibration:
    """Measure the example's noise and pick the regime. ``probes_x``: other inputs of the
    example's shape; a stochastic target must draw the same noise shapes for them to be judged
    by a fixed seed. Raises :class:`TargetFailure` when the target cannot run the example."""
    base = runner.forward(x)
    if runner.last_drew:  # its draws, recorded (a dispatch mode, slower: only for a target that draws)
        base = runner.forward(x, record=True)
    seconds = runner.last_seconds
    updated = tuple(runner.target.state.changed_buffers())
    value = base.out.value_BTF
    resolutions = {p.name: resolution_of(p.dtype) for p in base.out.float_parts}
    t = x.shape[1]
    stochastic = False
    if base.draws:
        other = runner.forward(x, seed=runner.seed + 1).out
        seconds = min(seconds, runner.last_seconds)
        _, flips_S, _ = difference(base.out, other, t, None)
        seeded = part_floors(base.out, other, t)
        stochastic = bool(flips_S.sum()) or any(seeded[k] > resolutions[k] for k in seeded)
    before = runner.target.state.hidden_state()
    again = runner.forward(x).out
    seconds = min(seconds, runner.last_seconds)
    delta_S, flips_S, _ = difference(base.out, again, t, None)
    floors = part_floors(base.out, again, t)
    changed = runner.target.state.changed(before, runner.target.state.hidden_state())
    repeats = int(flips_S.sum()) == 0 and all(floors[k] <= resolutions[k] for k in floors)
    aligned = not stochastic or all(_draws_of(runner, p, base) == base.draws for p in probes_x)
    regime = "distribution" if not (repeats and aligned) else "seeded" if stochastic else "deterministic"
    tolerances = (
        {k: max(FLOOR_FACTOR * floors[k], resolutions[k]) for k in floors}
        if regime != "distribution"
        else dict(resolutions)
    )
    finite = 0 if value is None else int(torch.isfinite(value).sum())
    differs = float(delta_S.max()) > 0 or int(flips_S.sum()) > 0
    return Calibration(
        base=base,
        resolutions=resolutions,
        stochastic=stochastic,
        floors=floors,
        regime=regime,
        tolerances=tolerances,
        nonfinite=0 if value is None else value.numel() - finite,
        comparable=base.out.exact_BTX is not None or finite > 0,
        seconds=seconds,
        stateful=_stateful(delta_S, flips_S, changed) if differs and changed else None,
        updated_buffers=updated,
    )


def _stateful(delta_S: Tensor, flips_S: Tensor, changed: list[str]) -> str:
    by = f"{float(delta_S.max()):.3g}" if float(delta_S.max()) > 0 else f"{int(flips_S.sum())} exact decisions"
    return (
        f"two identical calls differ by {by}: the target is stateful (its forward changes "
        f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} outside its buffers)"
    )


def _draws_of(runner: Runner, x: Tensor, base: Forward) -> object:
    try:
        return runner.forward(x, record=True).draws
    except TargetFailure:
        return base.draws  # a shape it cannot run tells nothing about its noise
