"""The comparison in one place: how a mode is judged (calibration: noise floors, tolerances,
the regime), how two forwards are compared (``compare``), the distribution regime's permutation
test, how many perturbed copies share a forward (``Packer``), and the judge of every
comparison of one mode (``Comparator``).

How many perturbed copies of the example share one forward, adapted to the target.

Packing copies along the batch saves the per-call overhead of tiny forwards, but a target whose
cost grows faster than its token count (a dense [N, E, C] dispatch with C proportional to N
costs N^2) gets slower per copy in a pack, and a large pack of it can run for minutes. So the
pack grows only while it pays. The doubling check
(:meth:`~moe.audit.comparator.Comparator.allow_batching`) times two copies in one forward:
packing starts at eight copies where the pair cost clearly less than two forwards, at four where
it cost about as much, and not at all where a copy cost clearly more in the pair than alone. A pack
doubles while its time per copy does not rise and the next pack is predicted (from the growth
seen so far) to stay under :data:`PACK_SECONDS`; it halves when a pack ran longer than that,
cost more per copy than a forward alone, or failed. Decisions read the fastest time seen at
each size, so one slow forward on a busy machine does not decide. A pack that fails or runs
past the time limit is re-run copy by copy: the target is judged NOT AUDITED only for its own
input. Which variants are compared never depends on these timings, only how many share a
forward.

Calibration: from forwards of the example alone, how one mode of a target is to be judged.

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

The distribution regime's test: do the draws of a variant come from the distribution of the
example's draws, at the outputs compared?

Shape legend: K draws (seeds) per input, B batch, S compared positions, F compared values per
position (float outputs, then exact decisions), M = B * S * F' compared elements (F' = F, or F
plus NaN / +inf / -inf indicators when some value is not finite; at most PROJECTED per position
after a random projection), P permutations.

A routing change moves a whole position's output, not one number, and noise from dropout or a
sampled expert is heavy-tailed (a kept value or a zero): a test on the largest single |z| over
thousands of elements has a null as wide as its observed value and no power at a handful of
draws. The statistic here is per position: the squared norm of the mean difference between the
variant's and the example's output vectors, each element scaled by its pooled standard deviation
over all 2K draws (at least its resolution, so rounding noise never counts), largest over
positions. Its null is the same statistic under relabellings of the draws that are exchangeable
when nothing changed; the p-value (1 + #{null >= observed}) / (1 + P) is then exact for any
output distribution (Good 2005, "Permutation, Parametric and Bootstrap Tests of Hypotheses",
ch. 3; the largest-over-positions form is Westfall and Young's max-T adjustment). Two designs:

* **independent draws** (seeds disjoint between the two inputs): any split of the 2K draws into
  two groups of K;
* **paired draws** (``paired``): draw i of both inputs under the same seed, the runner's rule
  for any two forwards it compares, used where both start from the same random op of the same
  shape, so the noise drawn before anything that follows the data (a noisy gate's Gaussian) is
  the same noise and cancels in their difference (with independent seeds, a noisy gate routes
  each token differently in every draw, and a capacity leak that moves a few tokens in most
  draws is lost in that noise). The relabellings swap the two draws within pairs (signs of the
  differences; all 2^K of them where that is at most P): under "no change" the two draws of a
  pair are exchangeable, being the same noise, or noise of one law drawn at other places of the
  stream (dropout masks whose rows follow the routing).

Relabelling stops early, with a sequential p-value, once the observed statistic is clearly
ordinary (:data:`STOP_EXCEEDANCES`).

The judge of every comparison in one mode, given the mode's :class:`Calibration`.

Shape legend: K draws (seeds) per input, B batch, S compared positions, F output values per
position (float outputs), X exact decisions per position, P copies in one packed forward.

Deterministic and seeded regimes: every comparison of the example's shape is between two
forwards of that shape under the same seed. Perturbed copies of a target that showed no batch
interference and reproduces itself in a doubled batch share forwards (packs sized by
:class:`~moe.audit.comparator.Packer`), the example riding along as copy 0 and serving as the
reference, so both sides of a comparison come from one call; one vectorised comparison judges a
whole pack (:func:`~moe.audit.comparator.compare`).

Distribution regime, and comparisons across shapes (a prefix, a sample alone) of a target whose
output depends on its seed: every variant first runs once under the audit seed (the screen);
the MAX_DISTRIBUTION_COMPARISONS variants that moved the outputs most there are then judged by
the permutation test of :mod:`moe.audit.comparator` on fresh draws under other seeds, draw i
of the example and of the variant under the same seed (a pair: the noise both draw in the same
shapes is the same noise); the screen only chooses, the test never sees its forwards, so its
level holds; with more draws for
a comparison the first draws leave suggestive; a change the last stage can neither call
significant nor dismiss is INCONCLUSIVE. The per-comparison level is derived from the probes
that compare forwards (:func:`per_comparison_alpha`).

NaN and inf are compared as values: a position whose NaN / inf pattern changes counts as a flip;
where both are NaN (or the same inf) nothing changed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe.audit.report import ProbeResult
from moe.audit.runner import Forward, Runner, TargetFailure, TargetTimeout
from moe.audit.target import Outputs

MAX_ROWS = 512
"""Most samples in one packed forward."""
MAX_VALUES = 2**24
"""Most output values (float64 once compared: 128 MiB) in one packed forward."""
PACK_SECONDS = 0.5
"""Longest a packed forward is meant to take (at least 4 forwards of the example, at most a
quarter of the per-forward time limit)."""
GAIN = 0.8
"""Packing starts unless a copy costs more than 1 / GAIN of a forward of the example in a pair;
a pack grows while its time per copy is at most 1 / GAIN of the next smaller size's (amortised
overhead, not a cost that grows faster than the copies)."""


class Packer:
    """The pack size for one mode of one target: ``size`` copies per forward (below 3: no
    packing). Decisions read the fastest time seen at each size, so one slow forward on a busy
    machine neither stops nor shrinks packing."""

    def __init__(self, samples: int, values_per_copy: int, one_s: float, timeout: float | None) -> None:
        self.limit = max(1, min(MAX_ROWS // max(1, samples), MAX_VALUES // max(1, values_per_copy)))
        self.one_s = one_s
        self.cap_s = max(PACK_SECONDS, 4 * one_s)
        if timeout:
            self.cap_s = min(self.cap_s, timeout / 4)
        self.size = 1
        self._best: dict[int, float] = {1: one_s}
        """The fastest forward seen with this many copies."""

    @property
    def packs(self) -> bool:
        """Whether copies share forwards (a pack holds the example and at least two variants)."""
        return self.size >= 3

    def start(self, pair_s: float, one_s: float) -> bool:
        """Two copies took ``pair_s`` and one ``one_s`` (timed together): start packing at four
        copies unless a copy cost clearly more in the pair than alone (a cost that grows faster
        than the tokens) or four would pass the cap."""
        self.one_s = self._best[1] = min(self.one_s, one_s)
        self._best[2] = min(self._best.get(2, pair_s), pair_s)
        if self._best[2] / 2 <= self.one_s / GAIN and self._best[2] * 2 <= self.cap_s:
            # Eight copies at once where the pair cost clearly less than two forwards (overhead, not work).
            sublinear = self._best[2] <= 2 * GAIN * self.one_s and self._best[2] * 4 <= self.cap_s
            self.size = min(self.limit, 8 if sublinear else 4)
        return self.packs

    def observe(self, copies: int, seconds: float) -> None:
        """Adapt to a pack of ``copies`` (the example's copy included) that took ``seconds``."""
        if seconds > self.cap_s:
            self.size = max(1, self.size // 2)
            return
        if copies < self.size:  # a last, partial pack tells little
            return
        best = self._best[copies] = min(self._best.get(copies, seconds), seconds)
        smaller = max(k for k in self._best if k < copies)
        per, smaller_per = best / copies, self._best[smaller] / smaller
        if per > self.one_s / GAIN:  # slower per copy than one forward each: smaller packs
            self.size = max(1, copies // 2)
        elif per <= smaller_per / GAIN and self.size < self.limit:
            growth = math.log2(max(best / self._best[smaller], 1.0)) / math.log2(copies / smaller)
            if best * 2**growth <= self.cap_s:
                self.size = min(self.limit, 2 * copies)

    def failed(self) -> None:
        """A pack raised or ran past the time limit: smaller packs from now on."""
        self.size = max(1, self.size // 4)


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


DRAWS = (8, 32, 64)
"""Draws per input at each stage: a comparison whose p-value is at most ESCALATE_P but not
significant gets the next stage's draws (more draws where the change is large); each stage is
tested at a third of the comparison's level, so the stages together keep it."""
ESCALATE_P = 0.05
"""A p-value at or below this (and not significant) buys the next stage's draws."""
INCONCLUSIVE_P = 0.01
"""After the last stage: a p-value at or below this that is not significant is INCONCLUSIVE
(a change the test could not tell from noise, nor dismiss), never "no leak"."""
PERMUTATIONS = 9999
"""Random relabellings per test: the smallest p-value, 1e-4, stays below every stage's level."""
PROJECTED = 64
"""Values per position beyond which the standardised values are randomly projected to this many
(a fixed Gaussian map, drawn before the labels are looked at: the test stays exact)."""
NULL_BUDGET = 2**24
"""Elements of the permutation null computed at once (chunks of permutations)."""
FIRST_PERMUTATIONS = 64
"""Relabellings in the first chunk; chunks double after it."""
STOP_EXCEEDANCES = 20
"""Relabellings stop once this many reached the observed statistic (the p-value is then that
count over the relabellings made, Besag and Clifford 1991, "Sequential Monte Carlo p-values",
Biometrika 78: valid, and exact enough far above any level used here): a clean target's
comparisons cost a few dozen relabellings, a leak's the full PERMUTATIONS."""
TIE = 1e-5
"""A relabelling's statistic within this relative distance below the observed one counts as a tie
(at least as extreme): float32 sums of the same values in another order differ in the last bits."""


@dataclass
class Outcome:
    """One distribution comparison."""

    p: float
    """Its permutation p-value."""
    changed_S: Tensor
    """bool [S]: positions whose own statistic exceeds the null's 1 - alpha quantile of the largest
    statistic (family-wise over positions) and whose mean moved beyond the resolution."""
    change_S: Tensor
    """float64 [S]: the largest |mean change| of a finite value at each position."""
    excess_S: Tensor
    """float64 [S]: that change over resolution x its entry's scale."""
    draws: int = 0
    """Draws per input it was decided on."""


def _indicators(values_KBSF: Tensor) -> Tensor:
    """[K, B, S, F'] values: the finite ones (0 elsewhere) and, when some is not finite, 0/1
    indicators of NaN, +inf and -inf."""
    finite = torch.isfinite(values_KBSF)
    parts = [torch.where(finite, values_KBSF, 0.0)]
    if not bool(finite.all()):
        parts += [values_KBSF.isnan().double(), (values_KBSF == math.inf).double(), (values_KBSF == -math.inf).double()]
    return torch.cat(parts, dim=-1)


def _relabel(
    statistic_PL: Callable[[Tensor], Tensor],
    observed: float,
    relabellings: Callable[[int], Tensor],
    every: Tensor | None,
    alpha: float,
    permutations: int,
    budget: int,
) -> tuple[float, float]:
    """(p, critical value of the max statistic at ``alpha``) from the relabellings of the draws:
    ``every`` one of them where they are at most ``permutations`` (the exact p-value), else
    ``relabellings(n)`` random ones, in doubling chunks of at most ``budget``, stopped early, once
    the observed value is clearly ordinary, with the sequential p of Besag and Clifford (1991) (h
    exceedances in L relabellings: p = h / L) and an infinite critical value (no position
    significant)."""
    if every is not None:
        null = torch.cat([statistic_PL(chunk).amax(1) for chunk in every.split(budget)]).sort().values
        n = null.numel()
        return int((null >= observed).sum()) / n, float(null[min(n - 1, math.ceil((1 - alpha) * n))])
    null_P: list[Tensor] = []
    done = exceed = 0
    while done < permutations:
        n = min(budget, max(FIRST_PERMUTATIONS, done), permutations - done)  # doubling chunks
        null_P.append(statistic_PL(relabellings(n)).amax(1))
        done += n
        exceed += int((null_P[-1] >= observed).sum())
        if exceed >= STOP_EXCEEDANCES:  # clearly not significant: no more relabelling
            return exceed / done, math.inf
    null = torch.cat(null_P).sort().values
    return (1.0 + exceed) / (1.0 + permutations), float(
        null[min(permutations - 1, math.ceil((1 - alpha) * permutations))]
    )


def distribution_change(
    ref_KBSF: Tensor,
    var_KBSF: Tensor,
    resolution_F: Tensor | float,
    alpha: float,
    permutations: int = PERMUTATIONS,
    gen: torch.Generator | None = None,
    rows_of: list[tuple[int, int, bool]] | None = None,
    paired: bool = False,
) -> Outcome:
    """The permutation test of the module docstring on K draws of each input.

    ``resolution_F``: per compared value (float outputs first, exact decisions after), the least
    relative change of a finite mean that counts (0 for exact decisions); a scalar applies to
    all. ``alpha``: the level at which positions are called changed. ``rows_of``: the column
    ranges of the separate outputs, and whether each is a router's weights (each entry's scale
    takes its own output's row, :func:`~moe.audit.comparator.entry_scale`; None: one output).
    ``paired``: draw i of both under one seed (the module docstring's two designs)."""
    k, b, s, f = ref_KBSF.shape
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    ref, var = ref_KBSF.double(), var_KBSF.double()
    mean_ref_BSF, mean_var_BSF = ref.mean(0), var.mean(0)
    res_F = torch.as_tensor(resolution_F, dtype=torch.float64).expand(f)
    ranges = rows_of if rows_of else [(0, f, False)]
    scale_BSF = torch.cat(
        [entry_scale(mean_ref_BSF[..., a:z], mean_var_BSF[..., a:z], w) for a, z, w in ranges], dim=-1
    )
    resolution_BSF = (res_F * scale_BSF).clamp_min(torch.finfo(torch.float64).tiny)
    y_NBSG = _indicators(torch.cat([ref, var]))
    g = y_NBSG.shape[-1]
    floor_BSG = torch.cat([resolution_BSF, torch.full((b, s, g - f), 0.5, dtype=torch.float64)], dim=-1)
    y_NBSG = y_NBSG - y_NBSG.mean(0)
    sd_BSG = torch.maximum(y_NBSG.std(0), floor_BSG)
    z_NBSG = y_NBSG / sd_BSG
    if g > PROJECTED:  # a fixed random projection per position: the squared norm is kept on average
        proj_GR = torch.randn(g, PROJECTED, generator=gen, dtype=torch.float64) / math.sqrt(PROJECTED)
        z_NBSG = z_NBSG @ proj_GR
    positions = b * s
    z_NM = z_NBSG.reshape(2 * k, -1).float()
    if paired:
        d_KM = z_NM[k:] - z_NM[:k]  # pair i: the variant's draw minus the example's

        def statistic_PL(signs_PK: Tensor) -> Tensor:
            """Per sign pattern and position: the squared norm of the mean signed difference."""
            mean_PM = (signs_PK @ d_KM) / k
            return (mean_PM.reshape(signs_PK.shape[0], positions, -1) ** 2).sum(-1)

        observed_w = torch.ones(1, k)
        relabellings = lambda n: torch.randint(0, 2, (n, k), generator=gen).float() * 2 - 1  # noqa: E731
        every = ((torch.arange(2**k)[:, None] >> torch.arange(k)) & 1).float() * 2 - 1 if 2**k <= permutations else None
    else:
        total_M = z_NM.sum(0)

        def statistic_PL(group_PN: Tensor) -> Tensor:
            """Per labelling and position: the squared distance between the groups' mean vectors."""
            diff_PM = (group_PN @ z_NM) * (2.0 / k) - total_M / k  # one group's mean minus the other's
            return (diff_PM.reshape(group_PN.shape[0], positions, -1) ** 2).sum(-1)

        observed_w = (torch.arange(2 * k) >= k).float()[None]
        relabellings = lambda n: (torch.rand(n, 2 * k, generator=gen).argsort(1) < k).float()  # noqa: E731
        every = None

    # The observed labelling through the same arithmetic as the null's, so that ties (discrete
    # outputs tie often) compare equal rather than by rounding.
    observed_L = statistic_PL(observed_w)[0]
    observed = float(observed_L.max()) * (1 - TIE)
    budget = max(1, NULL_BUDGET // max(1, z_NM.shape[1]))
    p, critical = _relabel(statistic_PL, observed, relabellings, every, alpha, permutations, budget)
    significant_BS = (observed_L > critical).reshape(b, s)
    mean_change_BSF = (mean_var_BSF - mean_ref_BSF).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    excess_BSF = mean_change_BSF / resolution_BSF
    counted_F = res_F > 0
    # A finite value changes only by more than its resolution; an exact decision or a NaN / inf
    # frequency by any amount.
    moved_BS = (excess_BSF[..., counted_F] > 1).any(-1) | (mean_change_BSF[..., ~counted_F] > 0).any(-1)
    if g > f:
        pattern_BS = (y_NBSG[:k, ..., f:].mean(0) - y_NBSG[k:, ..., f:].mean(0)).abs().amax(-1) > 0
        moved_BS = moved_BS | pattern_BS
    changed_S = (significant_BS & moved_BS).any(0)
    finite_change = torch.where(counted_F, mean_change_BSF, 0.0)
    return Outcome(
        p=p,
        changed_S=changed_S,
        change_S=finite_change.amax(dim=(0, 2)),
        excess_S=torch.where(counted_F, excess_BSF, 0.0).amax(dim=(0, 2)),
        draws=k,
    )


ALPHA = 0.01
"""Distribution regime: the family-wise false-positive rate of one mode of one audit."""
MAX_DISTRIBUTION_COMPARISONS = 4
"""Distribution comparisons per probe and mode: the variants the screen found moved most."""
SCREEN_PACK = 8
"""Copies per screening forward in the distribution regime (where packing pays at all)."""


class Misaligned(Exception):
    """A target judged by a fixed seed drew random numbers of other shapes for another input of
    the same shape: its noise depends on the data, the mode must be audited by distribution."""


@dataclass
class Variant:
    """One input to compare with the example."""

    x: Tensor
    """The input: the example's shape, or another batch size / length (batch, decode probes)."""
    upto: int
    """Compare output positions < upto."""
    rows: tuple[int, ...] | None = None
    """The samples compared (None: all of the example's samples); they must be samples the
    variant did not change, at the same index in the variant and in the example unless
    ``ref_rows`` says where the example holds them."""
    label: str = ""
    """What the variant is, for the report (e.g. "every sample's future = copies of (1, 5)")."""
    reference: Tensor | None = None
    """Compare with the forward of this input instead of the example's (the samples ``rows`` at
    the same index in both): a batch probe's input beside other samples against it alone.
    Deterministic regime only."""
    ref_rows: tuple[int, ...] | None = None
    """The example's samples that ``rows`` of the variant are compared with, in order (None:
    ``rows`` themselves): a later sample run alone sits at index 0 of its own forward."""


def spread(values: list, k: int) -> list:
    """At most k of the values, evenly spread, first and last included."""
    if len(values) <= k:
        return list(values)
    if k <= 1:
        return list(values[:k])
    idx = sorted({round(i * (len(values) - 1) / (k - 1)) for i in range(k)})
    return [values[i] for i in idx]


def per_comparison_alpha(forward_probes: int) -> float:
    """Bonferroni over every distribution comparison a mode can make: ``forward_probes`` probes
    that compare forwards, each at most MAX_DISTRIBUTION_COMPARISONS times as its screen chose
    and once more for the variant that moved the outputs in another mode
    (:meth:`Comparator.confirm`); each comparison's stages share its level
    (:data:`~moe.audit.comparator.DRAWS`)."""
    return ALPHA / ((MAX_DISTRIBUTION_COMPARISONS + 1) * max(1, forward_probes))


# -- bookkeeping ----------------------------------------------------------------------------
@dataclass
class Tally:
    """One probe in one mode: per output position, the largest change, the flips, whether it moved;
    the comparison whose change was largest against its tolerance; the outputs that moved."""

    name: str
    kind: str
    mode: str
    t: int
    regime: str
    delta_T: Tensor = field(init=False)
    flips_T: Tensor = field(init=False)
    moved_T: Tensor = field(init=False)
    probed_T: Tensor = field(init=False)
    comparisons: int = 0
    distribution_comparisons: int = 0
    p_value: float | None = None
    found_by: str | None = None
    """The label of the first variant that moved an output."""
    excess: float = 0.0
    """The largest change over its tolerance (:func:`~moe.audit.comparator.compare`)."""
    largest_by: str | None = None
    """The label of the variant with that largest change."""
    largest_p: float | None = None
    """Its permutation-test p-value (None: compared exactly)."""
    outputs: dict[str, None] = field(default_factory=dict)
    """The outputs that moved, in the order found."""
    draws: int = 0
    """The most draws per input a distribution comparison used."""
    screened: int = 0
    """Variants run once under the audit seed to choose the distribution comparisons."""
    inconclusive: list[str] = field(default_factory=list)
    """Distribution comparisons the last stage could neither call significant nor dismiss."""
    failures: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    exact_entries: int = 0
    """Exact entries (routing decisions, integer / bool outputs) compared directly, summed."""
    exact_changed: int = 0
    """How many of them changed."""
    found: Variant | None = field(default=None, repr=False)
    """The first variant that moved an output (:meth:`Comparator.confirm` retests it in another mode)."""
    moved_by: dict[int, Variant] = field(default_factory=dict, repr=False)
    """Per output position, the first variant that moved it (a straight path of inputs to it tells
    how the position moves: :func:`moe.audit.probes.path_changes`)."""

    def __post_init__(self) -> None:
        self.delta_T = torch.zeros(self.t, dtype=torch.float64)
        self.flips_T = torch.zeros(self.t, dtype=torch.long)
        self.moved_T = torch.zeros(self.t, dtype=torch.bool)
        self.probed_T = torch.zeros(self.t, dtype=torch.bool)

    @property
    def moved(self) -> bool:
        return bool(self.moved_T.any())

    def add(
        self,
        delta_S: Tensor,
        flips_S: Tensor,
        moved_S: Tensor,
        excess_S: Tensor,
        variant: Variant | None = None,
        p_value: float | None = None,
        outputs: Iterable[str] = (),
    ) -> None:
        label = variant.label if variant is not None else ""
        s = delta_S.numel()
        if s and float(excess_S.max()) > self.excess:
            self.excess, self.largest_by, self.largest_p = float(excess_S.max()), label or None, p_value
        self.delta_T[:s] = torch.maximum(self.delta_T[:s], delta_S)
        self.flips_T[:s] += flips_S
        self.moved_T[:s] |= moved_S
        self.probed_T[:s] = True
        self.comparisons += 1
        if bool(moved_S.any()):
            self.outputs.update(dict.fromkeys(outputs))
            if self.found_by is None:
                self.found_by, self.found = label or None, variant
            if variant is not None:
                for position in moved_S.nonzero().flatten().tolist():
                    self.moved_by.setdefault(position, variant)

    def add_diff(self, d: Diff, p: int, v: Variant) -> None:
        """Copy p of a compared pack, the comparison of variant ``v``."""
        if d.exact_entries_P is not None and d.exact_changed_P is not None:
            self.exact_entries += int(d.exact_entries_P[p])
            self.exact_changed += int(d.exact_changed_P[p])
        if d.same:  # nothing differed: only what was compared is recorded
            self.probed_T[: v.upto] = True
            self.comparisons += 1
            return
        u = v.upto
        self.add(d.delta_PS[p, :u], d.flips_PS[p, :u], d.moved_PS[p, :u], d.excess_PS[p, :u], v, None, d.moved_parts(p))

    def fail(self, failure: TargetFailure) -> None:
        self.failures.append((failure.shape, failure.what))

    def result(self, tolerance: float) -> ProbeResult:
        moved = self.moved_T.nonzero().flatten().tolist()
        probed = int(self.probed_T.sum())
        skipped = sorted({shape[1] for shape, _ in self.failures if len(shape) > 1})
        errors = list(dict.fromkeys(f"input {shape}: {msg}" for shape, msg in self.failures))
        return ProbeResult(
            name=self.name,
            mode=self.mode,
            kind=self.kind,
            leaks=bool(moved),
            max_abs_delta=float(self.delta_T.max()) if self.delta_T.numel() else 0.0,
            first_leaking_position=moved[0] if moved else None,
            leaking_positions=moved,
            fraction_affected=len(moved) / probed if probed else 0.0,
            routing_flips=int(self.flips_T.sum()),
            tolerance=tolerance,
            comparisons=self.comparisons,
            regime="distribution" if self.distribution_comparisons else self.regime,
            p_value=self.p_value,
            found_by=self.found_by,
            excess=self.excess,
            largest_change_by=self.largest_by,
            largest_change_p=self.largest_p,
            failed=len(self.failures),
            skipped_lengths=skipped,
            errors=errors[:3],
            leaking_outputs=list(self.outputs) if moved else [],
            draws=self.draws,
            inconclusive=[] if moved else list(self.inconclusive),
            screened=self.screened,
            changed_share=self.exact_changed / self.exact_entries if self.exact_entries else None,
        )


# -- the judge -------------------------------------------------------------------------------
class Comparator:
    """Judges every variant of one mode against the example, as ``cal`` says.

    Raises :class:`Misaligned` from :meth:`judge` when a target judged by a fixed seed turns out
    to draw data-dependent noise (the caller then judges the mode with ``cal.by_distribution()``).
    ``alpha``: the per-comparison level of the distribution regime.
    """

    def __init__(self, runner: Runner, x: Tensor, mode: str, cal: Calibration, alpha: float) -> None:
        self.runner, self.x, self.mode, self.cal, self.alpha = runner, x, mode, cal, alpha
        self.b, self.t = x.shape[0], x.shape[1]
        out = cal.base.out
        values = sum(0 if v is None else v[0].numel() for v in (out.value_BTF, out.exact_BTX))
        self.packer = Packer(self.b, self.b * values, cal.seconds, runner.timeout)
        self.batchable = False
        """Perturbed copies may share forwards exactly (deterministic and seeded regimes)."""
        self.screen_packs = False
        """Distribution regime: screening forwards may share forwards (they only rank variants)."""
        self.unpacked: str | None = None
        """Why packing stopped midway (a pack moved the example's own copy), for the report."""
        self._reference: Tensor | None = None
        self._gen = torch.Generator().manual_seed(runner.seed + 7)

    @property
    def base(self) -> Forward:
        return self.cal.base

    # -- batching ----------------------------------------------------------------------------
    def allow_batching(self) -> None:
        """Let perturbed copies share forwards from now on, if two copies of the example in one
        forward give what one forward of it gives (the same exact decisions, float changes within
        the tolerance; deterministic targets only: random draws differ between copies of a pack)
        and two copies cost less each than one (:class:`~moe.audit.comparator.Packer`). In the
        distribution regime screening forwards may share them whatever they give."""
        if self.cal.regime == "seeded":
            return
        doubled = torch.cat([self.x, self.x])
        try:
            twice = self.runner.forward(doubled).out
            pair_s = self.runner.last_seconds
            self.runner.forward(self.x)
            if not self.packer.start(pair_s, self.runner.last_seconds):
                # A second look: one slow forward decides nothing.
                self.runner.forward(doubled)
                pair_s = self.runner.last_seconds
                self.runner.forward(self.x)
                self.packer.start(pair_s, self.runner.last_seconds)
        except (TargetFailure, TargetTimeout):
            return
        if self.cal.regime == "distribution":
            self.screen_packs = True
            return
        for half in (twice.rows(0, self.b), twice.rows(self.b, 2 * self.b)):
            d = compare(self.base.out, half, 1, [self.t], None, self.cal.tolerances)
            if bool(d.moved_PS.any()):
                return
        self.batchable = True

    # -- judging ------------------------------------------------------------------------------
    def tally(self, name: str, kind: str) -> Tally:
        return Tally(name, kind, self.mode, self.t, self.cal.regime)

    def _by_distribution(self, v: Variant) -> bool:
        cross_shape = tuple(v.x.shape) != tuple(self.x.shape)
        return self.cal.regime == "distribution" or (cross_shape and self.cal.stochastic)

    def _packable(self, v: Variant) -> bool:
        return tuple(v.x.shape) == tuple(self.x.shape) and v.rows is None

    def judge(
        self, variants: Iterable[Variant], tally: Tally, stop_at_first: bool = False, enough: int | None = None
    ) -> ProbeResult:
        """Compare every variant with the example; record changes and failures in ``tally``.
        ``stop_at_first``: stop at the first forward (or distribution comparison) that moved an
        output (the verdict is made; the positions reported are those seen until then).
        ``enough``: stop once that many variants ran (in order; those that fail do not count)."""
        variants = list(variants)
        by_dist = [v for v in variants if self._by_distribution(v)]
        direct = [v for v in variants if not self._by_distribution(v)]
        packed = [v for v in direct if self.batchable and self._packable(v)]
        single = [v for v in direct if not (self.batchable and self._packable(v))]
        self._judge_packed(packed, tally, stop_at_first)
        for v in single:
            if (stop_at_first and tally.moved) or (enough is not None and tally.comparisons >= enough):
                break
            self._judge_one(v, tally)
        if by_dist and not (stop_at_first and tally.moved):
            self._judge_by_distribution(by_dist, tally, enough)
        return tally.result(self.cal.tolerance)

    @property
    def _rare_noise(self) -> bool:
        """The target drew random numbers in calibration, yet none of the other seeds changed its
        output: noise that rarely matters, or none. Every move it shows is confirmed before it
        counts: a same-shape forward must have drawn what the example drew (else, and for a
        variant compared with another input than the example, the mode is judged by distribution:
        :class:`Misaligned`), another shape is judged by distribution, and a packed copy (whose
        draws are not the example's) is run again alone."""
        return bool(self.base.draws) and not self.cal.stochastic

    def _judge_one(self, v: Variant, tally: Tally) -> None:
        same_shape = tuple(v.x.shape) == tuple(self.x.shape)
        try:
            ref = self.base.out if v.reference is None else self.runner.forward(v.reference).out
            fwd = self.runner.forward(v.x, record=self.cal.stochastic and same_shape)
        except TargetFailure as e:
            tally.fail(e)
            return
        if self.cal.stochastic and same_shape and fwd.draws != self.base.draws:
            raise Misaligned
        d = compare(ref, fwd.out, 1, [v.upto], v.rows, self.cal.tolerances, v.ref_rows)
        if self._rare_noise and bool(d.moved_PS.any()):
            if v.reference is not None:  # two forwards of other shapes: nothing to pair their noise with
                raise Misaligned
            if not same_shape:  # as the seeded regime judges another shape
                self._tested(v, tally, DRAWS)
                return
            if self.runner.forward(v.x, record=True).draws != self.base.draws:
                raise Misaligned
        tally.add_diff(d, 0, v)

    def _packed_forwards(
        self, variants: list[Variant], size: int | None = None
    ) -> Iterable[tuple[list[Variant], Diff | None]]:
        """(chunk, its comparison with the example's copy in the same forward) per packed
        forward; None where the pack failed, ran past the time limit or moved the example's own
        copy (its variants are then run one by one). ``size``: copies per forward, fixed (None: as the packer finds it pays)."""
        i = 0
        while i < len(variants):
            copies = self.packer.size if size is None else size
            if copies < 3 or (size is None and not self.batchable):
                yield variants[i:], None
                return
            chunk = variants[i : i + copies - 1]
            i += len(chunk)
            try:
                out = self.runner.forward(torch.cat([self.x] + [v.x for v in chunk])).out
            except (TargetFailure, TargetTimeout):
                self.packer.failed()
                yield chunk, None
                continue
            ref, rest = out.rows(0, self.b), out.rows(self.b, None)
            if size is None:
                self.packer.observe(len(chunk) + 1, self.runner.last_seconds)
                if bool(compare(self.base.out, ref, 1, [self.t], None, self.cal.tolerances).moved_PS.any()):
                    self.batchable = False  # the pack changed what the example's copy sees: none from now on
                    self.unpacked = (
                        f"a pack of {len(chunk) + 1} copies moved the example's own copy ({chunk[0].label}, ...)"
                    )
                    yield chunk, None
                    continue
            yield chunk, compare(ref, rest, len(chunk), [v.upto for v in chunk], None, self.cal.tolerances)

    def _judge_packed(self, variants: list[Variant], tally: Tally, stop_at_first: bool) -> None:
        for chunk, d in self._packed_forwards(variants):
            if d is None:
                for v in chunk:
                    if stop_at_first and tally.moved:
                        return
                    self._judge_one(v, tally)
                continue
            for j, v in enumerate(chunk):
                if self._rare_noise and bool(d.moved_PS[j].any()):  # its copy drew other noise than the example
                    self._judge_one(v, tally)
                else:
                    tally.add_diff(d, j, v)
            if stop_at_first and tally.moved:
                return

    # -- the distribution regime ---------------------------------------------------------------
    def _screen(self, variants: list[Variant], tally: Tally, enough: int | None) -> list[tuple[float, int, Variant]]:
        """(largest change over its tolerance under the audit seed, order, variant) per variant
        that ran (the first ``enough``): how the distribution comparisons are chosen."""
        scored: list[tuple[float, int, Variant]] = []
        packable = [v for v in variants if self.screen_packs and self._packable(v)]
        # A fixed pack size, whatever the timings: a random target's outputs depend on the pack
        # it ran in, and which variants are tested must not depend on how fast the machine was.
        for chunk, d in self._packed_forwards(packable, SCREEN_PACK):
            if d is None:
                continue
            scored += [
                (float(d.excess_PS[j].max()) + float(d.flips_PS[j].sum()), id(v), v) for j, v in enumerate(chunk)
            ]
        done = {id(v) for _, _, v in scored}
        for v in variants:
            if enough is not None and len(scored) >= enough:
                break
            if id(v) in done:
                continue
            try:
                out = self.runner.forward(v.x).out
            except TargetFailure as e:
                tally.fail(e)
                continue
            d = compare(self.base.out, out, 1, [v.upto], v.rows, self.cal.tolerances, v.ref_rows)
            scored.append((float(d.excess_PS.max()) + float(d.flips_PS.sum()), id(v), v))
        order = {id(v): i for i, v in enumerate(variants)}
        return sorted(((s, order[i], v) for s, i, v in scored), key=lambda e: (-e[0], e[1]))

    def _judge_by_distribution(self, variants: list[Variant], tally: Tally, enough: int | None) -> None:
        """The screen, then the distribution tests in order of the screen's change, up to the
        first significant one (in this regime every probe stops there)."""
        screened = self._screen(variants, tally, enough)
        tally.screened += len(screened)
        for _, _, v in screened[:MAX_DISTRIBUTION_COMPARISONS]:
            self._tested(v, tally, DRAWS)
            if tally.moved:  # the verdict is made; more tests would cost thousands of relabellings each
                return

    def _tested(self, v: Variant, tally: Tally, stages: tuple[int, ...]) -> None:
        """One distribution comparison of ``v`` (draws per input at each stage, ``stages``) into ``tally``."""
        try:
            outcome = self._test(v, stages)
        except TargetFailure as e:
            tally.fail(e)
            return
        zeros = torch.zeros(v.upto, dtype=torch.long)
        tally.add(outcome.change_S, zeros, outcome.changed_S, outcome.excess_S, v, outcome.p, self._named(outcome))
        tally.distribution_comparisons += 1
        tally.draws = max(tally.draws, outcome.draws)
        tally.p_value = outcome.p if tally.p_value is None else min(tally.p_value, outcome.p)
        level = self.alpha / len(stages)
        # Significant but below the resolution (a prefix's rounding, the same in every paired draw) is dismissed.
        if not bool(outcome.changed_S.any()) and outcome.draws == DRAWS[-1] and level < outcome.p <= INCONCLUSIVE_P:
            tally.inconclusive.append(
                f"{v.label}: mean change up to {float(outcome.change_S.max()):.3g} over {outcome.draws} draws per "
                f"input, p = {outcome.p:.1e}, not below the level {level:.1e} of one test"
            )

    def confirm(self, v: Variant, tally: Tally) -> ProbeResult:
        """Retest, in this mode judged by distribution, the variant that moved the outputs in
        another mode (the inputs are the same in every mode), into the probe's own ``tally``: on
        the last stage's draws at once, at the level reserved for it (:func:`per_comparison_alpha`).
        A variant compared with another input than the example is not retested."""
        if v.reference is None:
            self._tested(v, tally, DRAWS[-1:])
        return tally.result(self.cal.tolerance)

    def _named(self, outcome: Outcome) -> list[str]:
        """The outputs a distribution comparison saw change (all float outputs: the test is joint)."""
        return [p.name for p in self.base.out.parts] if bool(outcome.changed_S.any()) else []

    def _test(self, v: Variant, stages: tuple[int, ...] = DRAWS) -> Outcome:
        """The permutation test on ``stages[0]`` draws per input, then more while it stays
        suggestive; each stage at the comparison's level over the number of stages."""
        rows = slice(None) if v.rows is None else list(v.rows)
        ref_rows = rows if v.ref_rows is None else list(v.ref_rows)
        level = self.alpha / len(stages)
        paired = self._shares_noise(v)
        first = self.runner.seed + 1 + (0 if paired else DRAWS[-1])  # the reference's seeds, or disjoint ones
        var: list[Tensor] = []
        outcome: Outcome | None = None
        for k in stages:
            ref_KBSF = self._reference_draws(k)[:, ref_rows, : v.upto]
            var += [
                self._value(self.runner.forward(v.x, seed=first + i).out)[rows, : v.upto] for i in range(len(var), k)
            ]
            var_KBSF = torch.stack(var)
            if ref_KBSF.shape[-1] != var_KBSF.shape[-1]:  # another number of router calls: exact parts differ
                width = self._width()
                ref_KBSF, var_KBSF = ref_KBSF[..., :width], var_KBSF[..., :width]
            res_F, ranges = self._resolutions(ref_KBSF.shape[-1])
            outcome = distribution_change(
                ref_KBSF, var_KBSF, res_F, level, gen=self._gen, rows_of=ranges, paired=paired
            )
            if outcome.p <= level or outcome.p > ESCALATE_P:
                break
        assert outcome is not None
        return outcome

    def _shares_noise(self, v: Variant) -> bool:
        """Whether the variant, under the audit seed, makes its first random draw with the op and
        shape of the example's: then under one seed both start from the same noise (a noisy gate's
        Gaussian drawn before any draw whose shape follows the routing), and the test pairs draw i
        of both under seed i. Otherwise (the first draw already follows the data, another batch
        size or length, draws the runner cannot record) nothing is shared: the variant's draws
        run under seeds disjoint from the example's and the test relabels them freely."""
        if not self.base.draws:
            return False
        try:
            draws = self.runner.forward(v.x, record=True).draws
        except TargetFailure:
            return False
        return bool(draws) and draws[0] == self.base.draws[0]

    def _reference_draws(self, k: int) -> Tensor:
        """The example's outputs under seeds seed + 1 ... seed + k (kept and extended)."""
        have = 0 if self._reference is None else self._reference.shape[0]
        if have < k:
            more = [self._value(self.runner.forward(self.x, seed=self.runner.seed + 1 + i).out) for i in range(have, k)]
            new = torch.stack(more)
            self._reference = new if self._reference is None else torch.cat([self._reference, new])
        return self._reference[:k]

    @staticmethod
    def _value(out: Outputs) -> Tensor:
        """Float outputs and exact decisions side by side, as float64 [B, T, F + X] on the CPU."""
        parts = [p.double() for p in (out.value_BTF, out.exact_BTX) if p is not None]
        return torch.cat(parts, dim=-1).cpu()

    def _resolutions(self, width: int) -> tuple[Tensor, list[tuple[int, int, bool]]]:
        """Per compared column its resolution (0 for exact decisions); each output's columns and
        whether they are a router's weights."""
        res_F = torch.zeros(width, dtype=torch.float64)
        ranges = []
        offset = self._width()
        for p in self.base.out.parts:
            a, z = (p.start, p.stop) if not p.exact else (offset + p.start, offset + p.stop)
            if z > width:
                continue
            if not p.exact:
                res_F[a:z] = self.cal.resolutions[p.name]
            ranges.append((a, z, p.weights))
        covered = max((z for _, z, _ in ranges), default=0)
        if covered < width:
            ranges.append((covered, width, False))
        return res_F, ranges

    def _width(self) -> int:
        return 0 if self.base.out.value_BTF is None else self.base.out.value_BTF.shape[-1]
