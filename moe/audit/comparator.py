"""The judge of every comparison in one mode, given the mode's :class:`Calibration`.

Shape legend: K draws (seeds) per input, B batch, S compared positions, F output values per
position (float outputs), X exact decisions per position, P copies in one packed forward.

Deterministic and seeded regimes: every comparison of the example's shape is between two
forwards of that shape under the same seed. Perturbed copies of a target that showed no batch
interference and reproduces itself in a doubled batch share forwards (packs sized by
:class:`~moe.audit.packing.Packer`), the example riding along as copy 0 and serving as the
reference, so both sides of a comparison come from one call; one vectorised comparison judges a
whole pack (:func:`~moe.audit.compare.compare`).

Distribution regime, and comparisons across shapes (a prefix, a sample alone) of a target whose
output depends on its seed: every variant first runs once under the audit seed (the screen);
the MAX_DISTRIBUTION_COMPARISONS variants that moved the outputs most there are then judged by
the permutation test of :mod:`moe.audit.permutation` on fresh draws under other seeds, draw i
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

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe.audit.calibration import Calibration
from moe.audit.compare import Diff, compare
from moe.audit.packing import Packer
from moe.audit.permutation import DRAWS, ESCALATE_P, INCONCLUSIVE_P, Outcome, distribution_change
from moe.audit.report import ProbeResult
from moe.audit.runner import Forward, Runner, TargetFailure, TargetTimeout
from moe.audit.target import Outputs

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
    (:data:`~moe.audit.permutation.DRAWS`)."""
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
    """The largest change over its tolerance (:func:`~moe.audit.compare.compare`)."""
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
        and two copies cost less each than one (:class:`~moe.audit.packing.Packer`). In the
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
