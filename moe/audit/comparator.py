"""The judge of every comparison in one mode: noise, tolerance, regime, batching policy.

Shape legend: K draws (seeds) per input, B batch, S compared positions, F output features per
position, X exact decisions per position, M compared elements (B * S * F, times the kinds of
value kept when some are not finite), P permutations.

Built once per mode from forwards of the example itself:

* **deterministic regime**: the target repeats itself under a fixed seed and input shape (its
  random draws, if any, are the same ops of the same shapes for every input of that shape).
  Every comparison is then between two forwards of the same shape under the same seed; a float
  change beyond the tolerance (10x the repeat's noise floor, at least ``ulps`` of the output
  scale at the target's dtype) or any change of an exact decision counts.
* **distribution regime**: the target's output varies under a fixed seed and shape (a
  nondeterministic kernel, noise from an unseeded generator), or its random draws change
  shape with the data (dropout inside per-expert batches), so equal seeds do not mean equal
  noise. Each input is run under ``DRAWS`` seeds and a change counts only when a permutation
  test finds it significant (:func:`distribution_change`).

Comparisons between different input shapes (decode prefixes, a sample run alone) of a target
that draws random numbers are always judged by distribution: no seed gives two shapes the same
noise. NaN and inf are compared as values: a position whose NaN / inf pattern changes counts as
a flip; where both are NaN (or the same inf) nothing changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import Tensor

from moe.audit.report import ProbeResult
from moe.audit.runner import Forward, Runner, TargetFailure
from moe.audit.target import Outputs

FLOOR_FACTOR = 10.0
"""Tolerance = this times the noise floor (the largest change between two identical forwards)."""
ULPS_32, ULPS_16 = 100, 4
"""Least tolerance, in units of the output dtype's eps times the output scale: fp32 / fp64
outputs carry the accumulation-order differences of a changed batch or length (a few dozen ulp
at most for the widths audited); 16-bit outputs are rounded from fp32 accumulators, which hides
those differences but for one or two ulps."""
DRAWS = 8
"""Seeds per input in the distribution regime (C(16, 8) = 12870 ways to relabel the draws)."""
ALPHA = 0.01
"""Distribution regime: the family-wise false-positive rate of one mode of one audit."""
MAX_DISTRIBUTION_COMPARISONS = 12
"""Distribution comparisons per probe and mode (spread over the probe's variants)."""
DISTRIBUTION_PROBES = 4
"""Probes that compare forwards (random, adversarial, batch, decode); the Jacobian does not."""
PER_COMPARISON_ALPHA = ALPHA / (MAX_DISTRIBUTION_COMPARISONS * DISTRIBUTION_PROBES)
"""Bonferroni over every distribution comparison a mode can make."""
PERMUTATIONS = 9999
"""Random relabellings per permutation test: the smallest p-value is 1e-4 < PER_COMPARISON_ALPHA."""
MAX_ROWS = 512
"""Most samples in one forward when perturbed copies are concatenated along the batch."""


class Misaligned(Exception):
    """A target judged deterministic drew random numbers of other shapes for another input of
    the same shape: its noise depends on the data, the mode must be audited by distribution."""


@dataclass
class Variant:
    """One input to compare with the example."""

    x: Tensor
    """The input: the example's shape, or another batch size / length (batch, decode probes)."""
    upto: int
    """Compare output positions < upto."""
    rows: int | None = None
    """Compare only samples 0..rows-1 (None: all of the example's samples)."""


def spread(values: list, k: int) -> list:
    """At most k of the values, evenly spread, first and last included."""
    if len(values) <= k:
        return list(values)
    idx = sorted({round(i * (len(values) - 1) / (k - 1)) for i in range(k)})
    return [values[i] for i in idx]


def resolution_of(value_BTF: Tensor | None, dtype: torch.dtype | None) -> float:
    """The least change that counts: ulps of the dtype's eps times the largest finite |output|."""
    if value_BTF is None or dtype is None:
        return 0.0
    finite = value_BTF[torch.isfinite(value_BTF)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    ulps = ULPS_16 if torch.finfo(dtype).bits <= 16 else ULPS_32
    return ulps * torch.finfo(dtype).eps * scale


def difference(ref: Outputs, out: Outputs, upto: int, rows: int | None) -> tuple[Tensor, Tensor]:
    """Per position s < upto, over the compared rows: the largest finite float change (float64
    [S]) and the changed exact decisions plus changed NaN / inf entries (int64 [S])."""
    delta_S = torch.zeros(upto, dtype=torch.float64)
    flips_S = torch.zeros(upto, dtype=torch.long)
    r = slice(None) if rows is None else slice(0, rows)
    if ref.value_BTF is not None and out.value_BTF is not None:
        a, b = ref.value_BTF[r, :upto], out.value_BTF[r, :upto]
        both = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        if a.numel():
            delta_S = torch.where(both, a - b, 0.0).abs().amax(dim=(0, 2)).cpu()
            flips_S = flips_S + (~both & ~same).sum(dim=(0, 2)).cpu()
    if ref.exact_BTX is not None and out.exact_BTX is not None:
        a, b = ref.exact_BTX[r, :upto], out.exact_BTX[r, :upto]
        if a.shape[-1] == b.shape[-1] and a.numel():
            flips_S = flips_S + (a != b).sum(dim=(0, 2)).cpu()
    return delta_S, flips_S


def _elements(values_KBSF: Tensor) -> tuple[Tensor, Tensor]:
    """[K, M] elements to test and [M] their least scale: the finite values (0 where not finite)
    and, when some value is not finite, 0/1 indicators of NaN, +inf and -inf."""
    finite = torch.isfinite(values_KBSF)
    parts = [torch.where(finite, values_KBSF, 0.0)]
    if not bool(finite.all()):
        parts += [values_KBSF.isnan().double(), (values_KBSF == math.inf).double(), (values_KBSF == -math.inf).double()]
    k = values_KBSF.shape[0]
    return torch.stack(parts, 1).reshape(k, -1), torch.tensor([0.0] + [0.5] * (len(parts) - 1)).repeat_interleave(
        values_KBSF[0].numel()
    )


def distribution_change(
    ref_KBSF: Tensor,
    var_KBSF: Tensor,
    resolution: float,
    alpha: float = PER_COMPARISON_ALPHA,
    permutations: int = PERMUTATIONS,
    gen: torch.Generator | None = None,
) -> tuple[float, Tensor, Tensor]:
    """Do the K draws of the variant come from the same distribution as the K of the reference?

    Statistic: the largest |z| over all M compared elements, z = (mean of one group - mean of
    the other) / sd of the pooled 2K draws (at least ``resolution``, so rounding noise never
    counts). Null: the same statistic under ``permutations`` random relabellings of the 2K
    draws into two groups of K, which under "no change" are exchangeable; the p-value
    (1 + #{null >= observed}) / (1 + permutations) is exact, whatever the distribution of the
    outputs, so a clean target is flagged with probability at most ``alpha``. Elements whose
    own z exceeds the null's 1 - alpha quantile are the changed ones (max-statistic
    adjustment: the family-wise rate stays alpha), provided a finite value's mean moved by more
    than ``resolution`` (a significant change of rounding noise is no leak).

    Returns (p-value, changed_S bool per position, |mean change|_S the largest per position).
    """
    k, b, s, f = ref_KBSF.shape
    y_NM, floor_M = _elements(torch.cat([ref_KBSF, var_KBSF]).double())
    y_NM = y_NM - y_NM.mean(0)
    floor_M[floor_M == 0] = resolution
    sd_M = torch.maximum(y_NM.std(0), floor_M).clamp_min(torch.finfo(torch.float64).tiny)
    z_NM = (y_NM / sd_M).float()
    observed_M = (z_NM[k:].mean(0) - z_NM[:k].mean(0)).abs()
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    null_P = []
    for start in range(0, permutations, 1000):
        n = min(1000, permutations - start)
        group_PN = (torch.rand(n, 2 * k, generator=gen).argsort(1) < k).float()
        null_P.append(((group_PN @ z_NM) * (2.0 / k) - z_NM.sum(0) / k).abs().amax(1))
    null_P = torch.cat(null_P).sort().values
    exceed_M = permutations - torch.searchsorted(null_P, observed_M)
    p_M = (1.0 + exceed_M.double()) / (1.0 + permutations)
    mean_change_BSF = (var_KBSF.mean(0) - ref_KBSF.mean(0)).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    significant_PBSF = (p_M <= alpha).reshape(-1, b, s, f)
    # A finite value changes only by more than the resolution; a NaN / inf frequency by any amount.
    changed_BSF = (significant_PBSF[0] & (mean_change_BSF > resolution)) | significant_PBSF[1:].any(0)
    p = float(p_M.min()) if p_M.numel() else 1.0
    return p, changed_BSF.any(dim=(0, 2)), mean_change_BSF.amax(dim=(0, 2))


# -- bookkeeping ----------------------------------------------------------------------------
@dataclass
class Tally:
    """One probe in one mode: per output position, the largest change, the flips, whether it moved."""

    name: str
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
    failures: list[tuple[tuple[int, ...], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.delta_T = torch.zeros(self.t, dtype=torch.float64)
        self.flips_T = torch.zeros(self.t, dtype=torch.long)
        self.moved_T = torch.zeros(self.t, dtype=torch.bool)
        self.probed_T = torch.zeros(self.t, dtype=torch.bool)

    def add(self, delta_S: Tensor, flips_S: Tensor, moved_S: Tensor) -> None:
        s = delta_S.numel()
        self.delta_T[:s] = torch.maximum(self.delta_T[:s], delta_S)
        self.flips_T[:s] += flips_S
        self.moved_T[:s] |= moved_S
        self.probed_T[:s] = True
        self.comparisons += 1

    def fail(self, failure: TargetFailure) -> None:
        self.failures.append((failure.shape, f"{type(failure.error).__name__}: {failure.error}"))

    def result(self, tolerance: float) -> ProbeResult:
        moved = self.moved_T.nonzero()
        probed = int(self.probed_T.sum())
        skipped = sorted({shape[1] for shape, _ in self.failures if len(shape) > 1})
        errors = list(dict.fromkeys(f"input {shape}: {msg}" for shape, msg in self.failures))
        return ProbeResult(
            name=self.name,
            mode=self.mode,
            leaks=bool(moved.numel()),
            max_abs_delta=float(self.delta_T.max()) if self.delta_T.numel() else 0.0,
            first_leaking_position=int(moved[0]) if moved.numel() else None,
            fraction_affected=float(self.moved_T.sum()) / probed if probed else 0.0,
            routing_flips=int(self.flips_T.sum()),
            tolerance=tolerance,
            comparisons=self.comparisons,
            regime="distribution" if self.distribution_comparisons else self.regime,
            p_value=self.p_value,
            failed=len(self.failures),
            skipped_lengths=skipped,
            errors=errors[:3],
        )


# -- the judge -------------------------------------------------------------------------------
class Comparator:
    """Measures the example's noise in one mode and judges every variant against it.

    Raises :class:`TargetFailure` when the target cannot run the example itself, and
    :class:`Misaligned` from :meth:`judge` when a deterministic-regime target turns out to draw
    data-dependent noise (the caller then builds a new one with ``regime="distribution"``).
    """

    def __init__(self, runner: Runner, x: Tensor, mode: str, probes_x: Iterable[Tensor] = (), regime: str | None = None) -> None:
        self.runner, self.x, self.mode = runner, x, mode
        self.b, self.t = x.shape[0], x.shape[1]
        runner.record_draws = True
        self.base: Forward = runner.forward(x)
        self.resolution = resolution_of(self.base.out.value_BTF, self.base.out.dtype)
        self.stochastic = bool(self.base.draws) and self._seed_matters()
        """The target draws random numbers (with torch's generators) that change its output
        (not, e.g., an attention kernel with a dropout argument of 0)."""
        runner.record_draws = self.stochastic
        again = runner.forward(x)
        delta_S, flips_S = difference(self.base.out, again.out, self.t, None)
        self.floor = float(delta_S.max())
        repeats = int(flips_S.sum()) == 0 and self.floor <= self.resolution
        aligned = not self.stochastic or all(self._draws_of(p) == self.base.draws for p in probes_x)
        self.regime = regime or ("deterministic" if repeats and aligned else "distribution")
        self.nonfinite = 0 if self.base.out.value_BTF is None else int((~torch.isfinite(self.base.out.value_BTF)).sum())
        """Entries of the example's output that are NaN or inf."""
        self.tolerance = max(FLOOR_FACTOR * self.floor, self.resolution) if self.regime == "deterministic" else self.resolution
        self.batchable = False
        self._reference: Tensor | None = None
        self._gen = torch.Generator().manual_seed(runner.seed + 7)

    def _seed_matters(self) -> bool:
        other = self.runner.forward(self.x, seed=self.runner.seed + 1).out
        delta_S, flips_S = difference(self.base.out, other, self.t, None)
        return bool(flips_S.sum()) or float(delta_S.max()) > self.resolution

    def _draws_of(self, x: Tensor) -> object:
        try:
            return self.runner.forward(x).draws
        except TargetFailure:
            return self.base.draws  # a shape it cannot run tells nothing about its noise

    # -- batching ----------------------------------------------------------------------------
    def allow_batching(self) -> None:
        """Concatenate perturbed copies along the batch from now on, if two copies of the example
        in one forward give what one forward of it gives (the same exact decisions, float changes
        within the tolerance); only for deterministic targets that draw no random numbers."""
        if self.stochastic or self.regime != "deterministic":
            return
        try:
            twice = self.runner.forward(torch.cat([self.x, self.x])).out
        except TargetFailure:
            return
        for half in (twice.rows(0, self.b), twice.rows(self.b, 2 * self.b)):
            delta_S, flips_S = difference(self.base.out, half, self.t, None)
            if int(flips_S.sum()) or float(delta_S.max()) > self.tolerance:
                return
        self.batchable = True

    # -- judging ------------------------------------------------------------------------------
    def tally(self, name: str) -> Tally:
        return Tally(name, self.mode, self.t, self.regime)

    def _by_distribution(self, v: Variant) -> bool:
        cross_shape = tuple(v.x.shape) != tuple(self.x.shape)
        return self.regime == "distribution" or (cross_shape and self.stochastic)

    def judge(self, variants: Iterable[Variant], tally: Tally) -> ProbeResult:
        """Compare every variant with the example; record changes and failures in ``tally``."""
        variants = list(variants)
        by_dist = [v for v in variants if self._by_distribution(v)]
        direct = [v for v in variants if not self._by_distribution(v)]
        batched = [v for v in direct if self.batchable and tuple(v.x.shape) == tuple(self.x.shape) and v.rows is None]
        single = [v for v in direct if all(v is not w for w in batched)]
        for v in single:
            self._judge_one(v, tally)
        self._judge_batched(batched, tally)
        for v in spread(by_dist, MAX_DISTRIBUTION_COMPARISONS):
            self._judge_distribution(v, tally)
        return tally.result(self.tolerance)

    def _record(self, tally: Tally, ref: Outputs, out: Outputs, v: Variant) -> None:
        delta_S, flips_S = difference(ref, out, v.upto, v.rows)
        tally.add(delta_S, flips_S, (delta_S > self.tolerance) | (flips_S > 0))

    def _judge_one(self, v: Variant, tally: Tally) -> None:
        try:
            fwd = self.runner.forward(v.x)
        except TargetFailure as e:
            tally.fail(e)
            return
        if self.stochastic and tuple(v.x.shape) == tuple(self.x.shape) and fwd.draws != self.base.draws:
            raise Misaligned
        self._record(tally, self.base.out, fwd.out, v)

    def _judge_batched(self, variants: list[Variant], tally: Tally) -> None:
        """The example rides along as copy 0 of every forward and is the reference, so both
        outputs of a comparison come from the same call."""
        per = max(1, MAX_ROWS // self.b - 1)
        for i in range(0, len(variants), per):
            chunk = variants[i : i + per]
            try:
                out = self.runner.forward(torch.cat([self.x] + [v.x for v in chunk])).out
            except TargetFailure:
                for v in chunk:  # the batched shape failed: fall back to separate forwards
                    self._judge_one(v, tally)
                continue
            ref = out.rows(0, self.b)
            for j, v in enumerate(chunk):
                self._record(tally, ref, out.rows((j + 1) * self.b, (j + 2) * self.b), v)

    def _draws_KBSF(self, x: Tensor, upto: int, rows: int | None, first_seed: int) -> Tensor:
        """The outputs of ``DRAWS`` forwards under seeds first_seed, first_seed + 1, ..."""
        r = slice(None) if rows is None else slice(0, rows)
        seeds = [first_seed + k for k in range(DRAWS)]
        return torch.stack([self._value(self.runner.forward(x, seed=s).out)[r, :upto].cpu() for s in seeds])

    @staticmethod
    def _value(out: Outputs) -> Tensor:
        """Float outputs and exact decisions side by side, as float64 [B, T, F + X]."""
        parts = [p.double() for p in (out.value_BTF, out.exact_BTX) if p is not None]
        return torch.cat(parts, dim=-1)

    def _judge_distribution(self, v: Variant, tally: Tally) -> None:
        try:
            # Seeds of the variant's draws differ from the reference's: independent draws, so
            # under "no change" all 2K are exchangeable, as the permutation test assumes.
            if self._reference is None:
                self._reference = self._draws_KBSF(self.x, self.t, None, self.runner.seed + 1)
            var_KBSF = self._draws_KBSF(v.x, v.upto, v.rows, self.runner.seed + 1 + DRAWS)
        except TargetFailure as e:
            tally.fail(e)
            return
        ref_KBSF = self._reference[:, : (v.rows or self.b), : v.upto]
        if ref_KBSF.shape[-1] != var_KBSF.shape[-1]:  # another number of router calls: exact parts differ
            ref_KBSF, var_KBSF = ref_KBSF[..., : self._width()], var_KBSF[..., : self._width()]
        p, changed_S, change_S = distribution_change(ref_KBSF, var_KBSF, self.resolution, gen=self._gen)
        tally.add(change_S, torch.zeros(v.upto, dtype=torch.long), changed_S)
        tally.distribution_comparisons += 1
        tally.p_value = p if tally.p_value is None else min(tally.p_value, p)

    def _width(self) -> int:
        return 0 if self.base.out.value_BTF is None else self.base.out.value_BTF.shape[-1]
