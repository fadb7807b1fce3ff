"""Calibration: from forwards of the example alone, how one mode of a target is to be judged.

Shape legend: B batch, T sequence (S: the compared positions), F output features per
position, X exact decisions per position.

:func:`calibrate` is a function of the target's behaviour on the example: it calls the target
through the runner (which seeds every call and records random draws only when asked) and
returns a frozen :class:`Calibration`; nothing is toggled on the runner or the target.

* **deterministic regime**: the target repeats itself under a fixed seed and input shape (its
  random draws, if any, are the same ops of the same shapes for every input of that shape).
  A float change beyond the tolerance (``FLOOR_FACTOR`` times the repeat's relative noise floor,
  at least ``ulps`` of the target's dtype, times the scale of the compared entry) or any change
  of an exact decision counts.
* **distribution regime**: the target's output varies under a fixed seed and shape, or its
  random draws change shape with the data, so equal seeds do not mean equal noise; changes are
  then judged by a permutation test over several seeds (:mod:`moe.audit.comparator`).
* **stateful**: two identical forwards (buffers and generators reset) still differ and the forward
  changes the target's own attributes outside its buffers: no regime can judge it
  (:attr:`Calibration.stateful`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
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


def entry_scale(a_BSF: Tensor, b_BSF: Tensor) -> Tensor:
    """The scale a change of each entry is measured against: the larger of |before|, |after| and
    the median |entry| of its output row (so a near-zero entry is judged at its row's scale, and
    a massive activation raises the scale of its own entry only). NaN / inf count as 0."""
    a, b = a_BSF.nan_to_num(0.0, 0.0, 0.0).abs(), b_BSF.nan_to_num(0.0, 0.0, 0.0).abs()
    row = a.median(dim=-1, keepdim=True).values if a.shape[-1] else a
    return torch.maximum(torch.maximum(a, b), row)


def _rows(value: Tensor, rows: tuple[int, ...] | None) -> Tensor:
    return value if rows is None else value[list(rows)]


def difference(
    ref: Outputs, out: Outputs, upto: int, rows: tuple[int, ...] | None, tolerance: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Per position s < upto, over the compared samples ``rows`` (None: all): the largest change
    between values finite in both (float64 [S]); the changed exact decisions plus the entries
    whose NaN / inf pattern changed (int64 [S]; finite -> NaN is a change, NaN -> NaN is not);
    and the largest change over ``tolerance`` times its entry's scale (float64 [S]; above 1: it
    counts; with tolerance 1, the largest relative change)."""
    delta_S = torch.zeros(upto, dtype=torch.float64)
    flips_S = torch.zeros(upto, dtype=torch.long)
    excess_S = torch.zeros(upto, dtype=torch.float64)
    if ref.value_BTF is not None and out.value_BTF is not None:
        a, b = _rows(ref.value_BTF, rows)[:, :upto], _rows(out.value_BTF, rows)[:, :upto]
        both = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        if a.numel():
            change = torch.where(both, a - b, 0.0).abs()
            delta_S = change.amax(dim=(0, 2)).cpu()
            if bool(delta_S.any()):  # most comparisons of a causal target are exact: nothing to scale
                limit = (tolerance * entry_scale(a, b)).clamp_min(torch.finfo(torch.float64).tiny)
                excess_S = (change / limit).amax(dim=(0, 2)).cpu()
            flips_S = flips_S + (~both & ~same).sum(dim=(0, 2)).cpu()
    if ref.exact_BTX is not None and out.exact_BTX is not None:
        a, b = _rows(ref.exact_BTX, rows)[:, :upto], _rows(out.exact_BTX, rows)[:, :upto]
        if a.shape[-1] == b.shape[-1] and a.numel():
            flips_S = flips_S + (a != b).sum(dim=(0, 2)).cpu()
    return delta_S, flips_S, excess_S


@dataclass(frozen=True)
class Calibration:
    """How one mode of a target is judged, measured on the example. Tolerances are relative: a
    change counts above tolerance x the scale of its entry (:func:`entry_scale`)."""

    base: Forward
    """The example's forward under the audit seed (the reference of deterministic comparisons)."""
    resolution: float
    """The least relative float change that counts (:func:`resolution_of`)."""
    stochastic: bool
    """The target draws random numbers (with torch's generators) that change its output (not,
    e.g., an attention kernel with a dropout argument of 0)."""
    floor: float
    """The largest relative change between two forwards of the example under the same seed."""
    regime: str
    """"deterministic" or "distribution"."""
    tolerance: float
    """A relative float change above this counts (deterministic regime: FLOOR_FACTOR x floor, at
    least the resolution; distribution regime: the resolution)."""
    nonfinite: int
    """Entries of the example's float output that are NaN or inf."""
    comparable: bool
    """The example's output has something to compare: an exact decision or a finite value."""
    stateful: str | None = None
    """Why the mode cannot be judged: two identical forwards differ and the forward changes the
    target's attributes outside its buffers (None: not so)."""
    updated_buffers: tuple[str, ...] = ()
    """Buffers the example's forward changed (restored before every forward: no leak by itself)."""

    def by_distribution(self) -> Calibration:
        """The same measurements judged by distribution (for a target found to draw
        data-dependent noise midway)."""
        return dataclasses.replace(self, regime="distribution", tolerance=self.resolution)


def calibrate(runner: Runner, x: Tensor, probes_x: Iterable[Tensor] = ()) -> Calibration:
    """Measure the example's noise and pick the regime. ``probes_x``: other inputs of the
    example's shape; a stochastic target must draw the same noise shapes for them to be judged
    deterministically. Raises :class:`TargetFailure` when the target cannot run the example."""
    base = runner.forward(x, record=True)
    updated = tuple(runner.target.state.changed_buffers())
    value = base.out.value_BTF
    resolution = resolution_of(base.out.dtype)
    t = x.shape[1]
    stochastic = False
    if base.draws:
        _, flips_S, ratio_S = difference(base.out, runner.forward(x, seed=runner.seed + 1).out, t, None)
        stochastic = bool(flips_S.sum()) or float(ratio_S.max()) > resolution
    before = runner.target.state.hidden_state()
    delta_S, flips_S, ratio_S = difference(base.out, runner.forward(x).out, t, None)
    changed = runner.target.state.changed(before, runner.target.state.hidden_state())
    floor = float(ratio_S.max())
    repeats = int(flips_S.sum()) == 0 and floor <= resolution
    aligned = not stochastic or all(_draws_of(runner, p, base) == base.draws for p in probes_x)
    regime = "deterministic" if repeats and aligned else "distribution"
    finite = 0 if value is None else int(torch.isfinite(value).sum())
    differs = float(delta_S.max()) > 0 or int(flips_S.sum()) > 0
    return Calibration(
        base=base,
        resolution=resolution,
        stochastic=stochastic,
        floor=floor,
        regime=regime,
        tolerance=max(FLOOR_FACTOR * floor, resolution) if regime == "deterministic" else resolution,
        nonfinite=0 if value is None else value.numel() - finite,
        comparable=base.out.exact_BTX is not None or finite > 0,
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
