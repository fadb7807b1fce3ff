"""The judge of every comparison in one mode, given the mode's :class:`Calibration`.

Shape legend: K draws (seeds) per input, B batch, S compared positions, F output features per
position, X exact decisions per position, M compared elements (B * S * F, times the kinds of
value kept when some are not finite), P permutations.

Deterministic regime: every comparison is between two forwards of the same shape under the
same seed (perturbed copies of a batch-invariant target may share one forward). Distribution
regime: each input is run under ``DRAWS`` seeds and a change counts only when a permutation
test finds it significant (:func:`distribution_change`), at a per-comparison level the caller
derives from the probes that compare forwards (:func:`per_comparison_alpha`).

Comparisons between different input shapes (decode prefixes, a sample run alone) of a target
that draws random numbers are always judged by distribution: no seed gives two shapes the same
noise. NaN and inf are compared as values: a position whose NaN / inf pattern changes counts as
a flip; where both are NaN (or the same inf) nothing changed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe.audit.calibration import Calibration, difference, entry_scale
from moe.audit.report import ProbeResult
from moe.audit.runner import Forward, Runner, TargetFailure
from moe.audit.target import Outputs

DRAWS = 8
"""Seeds per input in the distribution regime (C(16, 8) = 12870 ways to relabel the draws)."""
ALPHA = 0.01
"""Distribution regime: the family-wise false-positive rate of one mode of one audit."""
MAX_DISTRIBUTION_COMPARISONS = 12
"""Distribution comparisons per probe and mode (spread over the probe's variants)."""
PERMUTATIONS = 9999
"""Random relabellings per permutation test: the smallest p-value, 1e-4, must stay below the
per-comparison level (:func:`per_comparison_alpha`; 2e-4 with the five built-in probes)."""
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
    rows: tuple[int, ...] | None = None
    """The samples compared (None: all of the example's samples); they must be samples the
    variant did not change, at the same index in the variant and in the example."""
    label: str = ""
    """What the variant is, for the report (e.g. "every sample's future = copies of (1, 5)")."""


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
    that compare forwards, each at most MAX_DISTRIBUTION_COMPARISONS times."""
    return ALPHA / (MAX_DISTRIBUTION_COMPARISONS * max(1, forward_probes))


def _elements(values_KBSF: Tensor, resolution_BSF: Tensor) -> tuple[Tensor, Tensor]:
    """[K, M] elements to test and [M] their least scale: the finite values (0 where not finite),
    at least their resolution, and, when some value is not finite, 0/1 indicators of NaN, +inf
    and -inf, at least 0.5."""
    finite = torch.isfinite(values_KBSF)
    parts = [torch.where(finite, values_KBSF, 0.0)]
    if not bool(finite.all()):
        parts += [values_KBSF.isnan().double(), (values_KBSF == math.inf).double(), (values_KBSF == -math.inf).double()]
    k, n = values_KBSF.shape[0], values_KBSF[0].numel()
    floor_M = torch.cat([resolution_BSF.flatten(), torch.full((n * (len(parts) - 1),), 0.5, dtype=torch.float64)])
    return torch.stack(parts, 1).reshape(k, -1), floor_M


def distribution_change(
    ref_KBSF: Tensor,
    var_KBSF: Tensor,
    resolution: float,
    alpha: float,
    permutations: int = PERMUTATIONS,
    gen: torch.Generator | None = None,
) -> tuple[float, Tensor, Tensor, Tensor]:
    """Do the K draws of the variant come from the same distribution as the K of the reference?

    Statistic: the largest |z| over all M compared elements, z = (mean of one group - mean of
    the other) / sd of the pooled 2K draws (at least its resolution, so rounding noise never
    counts). Null: the same statistic under ``permutations`` random relabellings of the 2K
    draws into two groups of K, which under "no change" are exchangeable; the p-value
    (1 + #{null >= observed}) / (1 + permutations) is exact, whatever the distribution of the
    outputs, so a clean target is flagged with probability at most ``alpha``. Elements whose
    own z exceeds the null's 1 - alpha quantile are the changed ones (max-statistic
    adjustment: the family-wise rate stays alpha), provided a finite value's mean moved by more
    than ``resolution`` times its entry's scale (a significant change of rounding noise is no leak).

    Returns (p-value, changed_S bool per position, |mean change|_S the largest per position, and
    the largest |mean change| over resolution x its entry's scale per position).
    """
    k, b, s, f = ref_KBSF.shape
    mean_ref_BSF, mean_var_BSF = ref_KBSF.double().mean(0), var_KBSF.double().mean(0)
    resolution_BSF = (resolution * entry_scale(mean_ref_BSF, mean_var_BSF)).clamp_min(torch.finfo(torch.float64).tiny)
    y_NM, floor_M = _elements(torch.cat([ref_KBSF, var_KBSF]).double(), resolution_BSF)
    y_NM = y_NM - y_NM.mean(0)
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
    mean_change_BSF = (mean_var_BSF - mean_ref_BSF).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    excess_BSF = mean_change_BSF / resolution_BSF
    significant_PBSF = (p_M <= alpha).reshape(-1, b, s, f)
    # A finite value changes only by more than its resolution; a NaN / inf frequency by any amount.
    changed_BSF = (significant_PBSF[0] & (excess_BSF > 1)) | significant_PBSF[1:].any(0)
    p = float(p_M.min()) if p_M.numel() else 1.0
    return p, changed_BSF.any(dim=(0, 2)), mean_change_BSF.amax(dim=(0, 2)), excess_BSF.amax(dim=(0, 2))


# -- bookkeeping ----------------------------------------------------------------------------
@dataclass
class Tally:
    """One probe in one mode: per output position, the largest change, the flips, whether it moved;
    and the comparison whose change was largest against its tolerance."""

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
    """The largest change over its tolerance (:func:`~moe.audit.calibration.difference`)."""
    largest_by: str | None = None
    """The label of the variant with that largest change."""
    largest_p: float | None = None
    """Its permutation-test p-value (None: compared exactly)."""
    failures: list[tuple[tuple[int, ...], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.delta_T = torch.zeros(self.t, dtype=torch.float64)
        self.flips_T = torch.zeros(self.t, dtype=torch.long)
        self.moved_T = torch.zeros(self.t, dtype=torch.bool)
        self.probed_T = torch.zeros(self.t, dtype=torch.bool)

    def add(
        self,
        delta_S: Tensor,
        flips_S: Tensor,
        moved_S: Tensor,
        excess_S: Tensor,
        label: str = "",
        p_value: float | None = None,
    ) -> None:
        s = delta_S.numel()
        if s and float(excess_S.max()) > self.excess:
            self.excess, self.largest_by, self.largest_p = float(excess_S.max()), label or None, p_value
        self.delta_T[:s] = torch.maximum(self.delta_T[:s], delta_S)
        self.flips_T[:s] += flips_S
        self.moved_T[:s] |= moved_S
        self.probed_T[:s] = True
        self.comparisons += 1
        if self.found_by is None and bool(moved_S.any()):
            self.found_by = label or None

    def fail(self, failure: TargetFailure) -> None:
        self.failures.append(
            (failure.shape, f"{type(failure.error).__name__}: {failure.error} (raised at {failure.where})")
        )

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
        )


# -- the judge -------------------------------------------------------------------------------
class Comparator:
    """Judges every variant of one mode against the example, as ``cal`` says.

    Raises :class:`Misaligned` from :meth:`judge` when a deterministic-regime target turns out
    to draw data-dependent noise (the caller then judges the mode with ``cal.by_distribution()``).
    ``alpha``: the per-comparison level of the distribution regime.
    """

    def __init__(self, runner: Runner, x: Tensor, mode: str, cal: Calibration, alpha: float) -> None:
        self.runner, self.x, self.mode, self.cal, self.alpha = runner, x, mode, cal, alpha
        self.b, self.t = x.shape[0], x.shape[1]
        self.batchable = False
        self._reference: Tensor | None = None
        self._gen = torch.Generator().manual_seed(runner.seed + 7)

    @property
    def base(self) -> Forward:
        return self.cal.base

    # -- batching ----------------------------------------------------------------------------
    def allow_batching(self) -> None:
        """Concatenate perturbed copies along the batch from now on, if two copies of the example
        in one forward give what one forward of it gives (the same exact decisions, float changes
        within the tolerance); only for deterministic targets that draw no random numbers."""
        if self.cal.stochastic or self.cal.regime != "deterministic":
            return
        try:
            twice = self.runner.forward(torch.cat([self.x, self.x])).out
        except TargetFailure:
            return
        for half in (twice.rows(0, self.b), twice.rows(self.b, 2 * self.b)):
            _, flips_S, excess_S = difference(self.base.out, half, self.t, None, self.cal.tolerance)
            if int(flips_S.sum()) or float(excess_S.max()) > 1:
                return
        self.batchable = True

    # -- judging ------------------------------------------------------------------------------
    def tally(self, name: str, kind: str) -> Tally:
        return Tally(name, kind, self.mode, self.t, self.cal.regime)

    def _by_distribution(self, v: Variant) -> bool:
        cross_shape = tuple(v.x.shape) != tuple(self.x.shape)
        return self.cal.regime == "distribution" or (cross_shape and self.cal.stochastic)

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
        return tally.result(self.cal.tolerance)

    def _record(self, tally: Tally, ref: Outputs, out: Outputs, v: Variant) -> None:
        delta_S, flips_S, excess_S = difference(ref, out, v.upto, v.rows, self.cal.tolerance)
        tally.add(delta_S, flips_S, (excess_S > 1) | (flips_S > 0), excess_S, v.label)

    def _judge_one(self, v: Variant, tally: Tally) -> None:
        same_shape = tuple(v.x.shape) == tuple(self.x.shape)
        try:
            fwd = self.runner.forward(v.x, record=self.cal.stochastic and same_shape)
        except TargetFailure as e:
            tally.fail(e)
            return
        if self.cal.stochastic and same_shape and fwd.draws != self.base.draws:
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

    def _draws_KBSF(self, x: Tensor, upto: int, rows: tuple[int, ...] | None, first_seed: int) -> Tensor:
        """The outputs of ``DRAWS`` forwards under seeds first_seed, first_seed + 1, ..."""
        r = slice(None) if rows is None else list(rows)
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
        rows = slice(None) if v.rows is None else list(v.rows)
        ref_KBSF = self._reference[:, rows, : v.upto]
        if ref_KBSF.shape[-1] != var_KBSF.shape[-1]:  # another number of router calls: exact parts differ
            ref_KBSF, var_KBSF = ref_KBSF[..., : self._width()], var_KBSF[..., : self._width()]
        p, changed_S, change_S, excess_S = distribution_change(
            ref_KBSF, var_KBSF, self.cal.resolution, self.alpha, gen=self._gen
        )
        tally.add(change_S, torch.zeros(v.upto, dtype=torch.long), changed_S, excess_S, v.label, p)
        tally.distribution_comparisons += 1
        tally.p_value = p if tally.p_value is None else min(tally.p_value, p)

    def _width(self) -> int:
        return 0 if self.base.out.value_BTF is None else self.base.out.value_BTF.shape[-1]
