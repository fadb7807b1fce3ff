"""How one mode of a target is to be judged, measured on forwards of the example alone.

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
  then judged by a permutation test over several seeds (:mod:`moe.audit.permutation`).
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

from moe.audit.compare import difference, part_floors, resolution_of
from moe.audit.runner import Forward, Runner, TargetFailure

FLOOR_FACTOR = 10.0
"""Tolerance = this times the noise floor (the largest relative change between two identical forwards)."""
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
    """The target draws random numbers (with torch's generators) that changed its output under
    one of :data:`NOISE_SEEDS` other seeds (not, e.g., an attention kernel with a dropout argument
    of 0)."""
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
    updated_parameters: tuple[str, ...] = ()
    """Parameters the example's forward changed in place (restored likewise from then on)."""

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


NOISE_SEEDS = 8
"""A target that draws random numbers is called random (the seeded or distribution regime) when
its output under one of this many other seeds differs from the audit seed's. Noise that rarely
changes the output (a drop path over two samples) can pass all of them: a target judged by a
fixed seed that drew random numbers has every move it shows confirmed (:class:`Comparator`)."""


def calibrate(runner: Runner, x: Tensor, probes_x: Iterable[Tensor] = ()) -> Calibration:
    """Measure the example's noise and pick the regime. ``probes_x``: other inputs of the
    example's shape; a stochastic target must draw the same noise shapes for them to be judged
    by a fixed seed. Raises :class:`TargetFailure` when the target cannot run the example."""
    base = runner.forward(x)
    moved_parameters = tuple(runner.target.state.changed_parameters())  # restored before every forward from now on
    if runner.last_drew:  # its draws, recorded (a dispatch mode, slower: only for a target that draws)
        base = runner.forward(x, record=True)
    seconds = runner.last_seconds
    updated = tuple(runner.target.state.changed_buffers())
    value = base.out.value_BTF
    resolutions = {p.name: resolution_of(p.dtype) for p in base.out.float_parts}
    t = x.shape[1]
    stochastic = False
    for seed in range(runner.seed + 1, runner.seed + 1 + (NOISE_SEEDS if base.draws else 0)):
        other = runner.forward(x, seed=seed).out
        seconds = min(seconds, runner.last_seconds)
        _, flips_S, _ = difference(base.out, other, t, None)
        seeded = part_floors(base.out, other, t)
        stochastic = bool(flips_S.sum()) or any(seeded[k] > resolutions[k] for k in seeded)
        if stochastic:
            break
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
        updated_parameters=moved_parameters,
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
