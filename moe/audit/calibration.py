"""Calibration: from forwards of the example alone, how one mode of a target is to be judged.

Shape legend: B batch, T sequence (S: the compared positions), F output features per
position, X exact decisions per position.

:func:`calibrate` is a function of the target's behaviour on the example: it calls the target
through the runner (which seeds every call and records random draws only when asked) and
returns a frozen :class:`Calibration`; nothing is toggled on the runner or the target.

* **deterministic regime**: the target repeats itself under a fixed seed and input shape (its
  random draws, if any, are the same ops of the same shapes for every input of that shape).
  A float change beyond the tolerance (``FLOOR_FACTOR`` times the repeat's noise floor, at least
  ``ulps`` of the output scale at the target's dtype) or any change of an exact decision counts.
* **distribution regime**: the target's output varies under a fixed seed and shape, or its
  random draws change shape with the data, so equal seeds do not mean equal noise; changes are
  then judged by a permutation test over several seeds (:mod:`moe.audit.comparator`).
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
"""Tolerance = this times the noise floor (the largest change between two identical forwards)."""
ULPS_32, ULPS_16 = 100, 4
"""Least tolerance, in units of the output dtype's eps times the output scale: fp32 / fp64
outputs carry the accumulation-order differences of a changed batch or length (a few dozen ulp
at most for the widths audited); 16-bit outputs are rounded from fp32 accumulators, which hides
those differences but for one or two ulps."""


def resolution_of(value_BTF: Tensor | None, dtype: torch.dtype | None) -> float:
    """The least change that counts: ulps of the dtype's eps times the largest finite |output|."""
    if value_BTF is None or dtype is None:
        return 0.0
    finite = value_BTF[torch.isfinite(value_BTF)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    ulps = ULPS_16 if torch.finfo(dtype).bits <= 16 else ULPS_32
    return ulps * torch.finfo(dtype).eps * scale


def _rows(value: Tensor, rows: tuple[int, ...] | None) -> Tensor:
    return value if rows is None else value[list(rows)]


def difference(ref: Outputs, out: Outputs, upto: int, rows: tuple[int, ...] | None) -> tuple[Tensor, Tensor]:
    """Per position s < upto, over the compared samples ``rows`` (None: all): the largest change
    between values finite in both (float64 [S]), and the changed exact decisions plus the entries
    whose NaN / inf pattern changed (int64 [S]; finite -> NaN is a change, NaN -> NaN is not)."""
    delta_S = torch.zeros(upto, dtype=torch.float64)
    flips_S = torch.zeros(upto, dtype=torch.long)
    if ref.value_BTF is not None and out.value_BTF is not None:
        a, b = _rows(ref.value_BTF, rows)[:, :upto], _rows(out.value_BTF, rows)[:, :upto]
        both = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        if a.numel():
            delta_S = torch.where(both, a - b, 0.0).abs().amax(dim=(0, 2)).cpu()
            flips_S = flips_S + (~both & ~same).sum(dim=(0, 2)).cpu()
    if ref.exact_BTX is not None and out.exact_BTX is not None:
        a, b = _rows(ref.exact_BTX, rows)[:, :upto], _rows(out.exact_BTX, rows)[:, :upto]
        if a.shape[-1] == b.shape[-1] and a.numel():
            flips_S = flips_S + (a != b).sum(dim=(0, 2)).cpu()
    return delta_S, flips_S


@dataclass(frozen=True)
class Calibration:
    """How one mode of a target is judged, measured on the example."""

    base: Forward
    """The example's forward under the audit seed (the reference of deterministic comparisons)."""
    resolution: float
    """The least float change that counts (:func:`resolution_of`)."""
    stochastic: bool
    """The target draws random numbers (with torch's generators) that change its output (not,
    e.g., an attention kernel with a dropout argument of 0)."""
    floor: float
    """The largest change between two forwards of the example under the same seed."""
    regime: str
    """"deterministic" or "distribution"."""
    tolerance: float
    """A float change above this counts (deterministic regime: FLOOR_FACTOR x floor, at least the
    resolution; distribution regime: the resolution)."""
    nonfinite: int
    """Entries of the example's float output that are NaN or inf."""
    comparable: bool
    """The example's output has something to compare: an exact decision or a finite value."""

    def by_distribution(self) -> Calibration:
        """The same measurements judged by distribution (for a target found to draw
        data-dependent noise midway)."""
        return dataclasses.replace(self, regime="distribution", tolerance=self.resolution)


def calibrate(runner: Runner, x: Tensor, probes_x: Iterable[Tensor] = ()) -> Calibration:
    """Measure the example's noise and pick the regime. ``probes_x``: other inputs of the
    example's shape; a stochastic target must draw the same noise shapes for them to be judged
    deterministically. Raises :class:`TargetFailure` when the target cannot run the example."""
    base = runner.forward(x, record=True)
    value = base.out.value_BTF
    resolution = resolution_of(value, base.out.dtype)
    t = x.shape[1]
    stochastic = False
    if base.draws:
        delta_S, flips_S = difference(base.out, runner.forward(x, seed=runner.seed + 1).out, t, None)
        stochastic = bool(flips_S.sum()) or float(delta_S.max()) > resolution
    delta_S, flips_S = difference(base.out, runner.forward(x).out, t, None)
    floor = float(delta_S.max())
    repeats = int(flips_S.sum()) == 0 and floor <= resolution
    aligned = not stochastic or all(_draws_of(runner, p, base) == base.draws for p in probes_x)
    regime = "deterministic" if repeats and aligned else "distribution"
    finite = 0 if value is None else int(torch.isfinite(value).sum())
    return Calibration(
        base=base,
        resolution=resolution,
        stochastic=stochastic,
        floor=floor,
        regime=regime,
        tolerance=max(FLOOR_FACTOR * floor, resolution) if regime == "deterministic" else resolution,
        nonfinite=0 if value is None else value.numel() - finite,
        comparable=base.out.exact_BTX is not None or finite > 0,
    )


def _draws_of(runner: Runner, x: Tensor, base: Forward) -> object:
    try:
        return runner.forward(x, record=True).draws
    except TargetFailure:
        return base.draws  # a shape it cannot run tells nothing about its noise
