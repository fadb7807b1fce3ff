"""The report in one place: per probe and per target what was found (``ProbeResult``,
``AuditReport``), its text and JSON, the advice for a leak's mechanism, and the built-in
suite's summary table.

Plain-text helpers the audit's reports share: a yes / no word, an aligned table.

What to do after an audit, by the mechanism its evidence shows (never one text for every leak).

* a nonzero Jacobian d output[t] / d input[> t]: the output reads later inputs through a
  differentiable path (a mean over the sequence, a roll or shift in time, unmasked attention, or a
  router's weights normalised over the tokens): make it causal; the audit cannot tell whether it
  is a router's, so a causal router is named only as the remedy for that case, and only for a target
  with something named as routing (or a callable, which shows nothing). BatchNorm layers that
  normalise with the batch's statistics in a leaking mode are named as the mechanism there. Where forwards also
  moved outputs at positions whose gradient to later inputs is zero
  (:func:`moved_without_gradient`), a discrete change comes with it (a router normalising its
  weights over positions and picking positions gives both), and the remedies below apply as well;
* a router of the target that claims the leak says its own mechanism: expert choice over
  positions (each expert takes its top tokens of the sequence or batch) -> ``ec_threshold`` /
  ``ec_predictor``; capacity kept by score (or GShard's choice order) -> ``priority="position"``
  with ``capacity_scope="prefix"``;
* a discrete change with neither (an opaque target): which tokens are served depends on later
  tokens, and the audit cannot tell which of the two; both remedies, each with its condition;
* buffers the forward updates (state carried from one call to the next, e.g. loss-free balancing
  biases): the audit restores them before every forward, so they are no leak; nothing to change.

Audit results: one ProbeResult per probe and mode, an AuditReport per target, the table, JSON.

The built-in suite's summary: one row per target, what it claims against what the audit found.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Protocol

from moe.routing import Claims


def yes_no(flag: bool | None) -> str:
    """yes / no, and "not tested" for None (a property no comparison could check)."""
    return "not tested" if flag is None else "yes" if flag else "no"


def format_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


class Findings(Protocol):
    """What the advice reads of a report (``moe.audit.report.AuditReport``, which imports this
    module: named here by what it has, not imported back)."""

    leaks: bool
    probes: list
    mechanisms: list[str]
    routing_named: list[str] | None
    batch_statistics: dict[str, list[str]]
    leaks_in: list[str]
    updated_buffers: list[str]
    updated_parameters: list[str]


EXPERT_CHOICE, CAPACITY_BY_SCORE = "expert choice", "capacity by score"
"""The routing mechanisms the audit can name (from a router's own declaration)."""
_FIX = {
    EXPERT_CHOICE: "expert choice over positions (each expert takes its top tokens of the group): use ec_threshold "
    "or ec_predictor (thresholds or a predictor learned from expert choice, causal at inference), or dropless topk",
    CAPACITY_BY_SCORE: "capacity kept by score or by choice order (a later token takes an earlier token's slot: with "
    "a higher score, or with its first choice queued before the earlier token's second): use capacity with "
    'priority="position" and capacity_scope="prefix" (slots counted over the prefix), or dropless topk',
}
_LAYER = {
    EXPERT_CHOICE: 'router="ec_threshold"',
    CAPACITY_BY_SCORE: 'router="capacity", priority="position", capacity_scope="prefix"',
}
"""The MoELayer arguments that put each mechanism's causal replacement into a user's block."""


def router_mechanism(router: object) -> str | None:
    """The mechanism of one of our routers, read from its registered name and options."""
    name = getattr(router, "name", None)
    if name in ("expert_choice", "ec_predictor", "ec_threshold"):
        return EXPERT_CHOICE
    if name == "capacity" and getattr(router, "priority", None) in ("score", "choice"):
        return CAPACITY_BY_SCORE
    return None


def advice(report: Findings) -> list[str]:
    """Lines for the summary: what the evidence says the leak is and what to use instead (none
    without a leak), and a note on buffers the forward updates."""
    out = []
    if report.leaks:
        continuous = [p for p in report.probes if p.name == "jacobian" and p.leaks]
        discrete = [p for p in report.probes if p.kind == "future" and p.compares_forwards and p.leaks]
        beyond = moved_without_gradient(report.probes)
        norms = sorted({n for m in report.leaks_in for n in report.batch_statistics.get(m, [])})
        if continuous and norms:
            out.append(
                f"mechanism: {', '.join(norms)} (BatchNorm) normalise with the mean and variance over every "
                "sample and position of the batch in "
                + " and ".join(m for m in report.leaks_in if report.batch_statistics.get(m))
                + " mode, so each output reads later positions and the other samples: normalise per position "
                "(LayerNorm, RMSNorm) or with fixed statistics"
            )
        batch_only = bool(norms) and all(report.batch_statistics.get(m) for m in report.leaks_in)
        unrouted = report.routing_named == []  # a module with nothing named as routing (None: a callable)
        no_router = "Nothing in the target is named as routing (a router, expert, MoE or gate): no router is advised"
        choice = (
            "a choice over the sequence (a top-k, sort or argmax over positions, a threshold on a statistic of them)"
        )
        if continuous and not beyond and not batch_only:  # else BatchNorm, said above, accounts for every mode
            out.append(
                "mechanism: the output at t reads later inputs through a differentiable path (d output[t] / "
                "d input[> t] is nonzero: a mean over the sequence, a shift or roll in time, unmasked attention, a "
                "convolution padded on the right, or weights normalised over the positions"
                + (
                    ", as a router's softmax over the tokens); make that computation causal (a mask or a shift). "
                    "The audit cannot tell whether the path is a router's: where it is one's weights over the tokens "
                    "(expert choice), a causal router (ec_threshold, ec_predictor or dropless topk) removes it, and "
                    "any choice of positions that comes with it"
                    if not unrouted
                    else f"); make that computation causal (a mask, padding on the left only, or a shift). {no_router}"
                )
            )
        elif continuous and beyond and unrouted:
            out.append(
                "mechanism: the output at t reads later inputs through a differentiable path (d output[t] / "
                f"d input[> t] is nonzero), and outputs at positions {_ranges(beyond)} also moved where that gradient "
                f"is zero or jumped on a straight path to another future: {choice} besides it, or a dependence too "
                "weak at the example for its gradient to count; make the differentiable computation causal (a mask "
                f"or a shift) and any choice per position or over the prefix. {no_router}"
            )
        elif continuous and beyond:
            out.append(
                "mechanism: the output at t reads later inputs through a differentiable path (d output[t] / "
                "d input[> t] is nonzero), and outputs at positions "
                f"{_ranges(beyond)} also moved where that gradient is zero or jumped on a straight path to another "
                "future: a discrete change besides it. A router whose weights are normalised over "
                "positions (a softmax over the tokens) and that picks positions gives both: a causal router removes "
                "both; otherwise make the differentiable computation causal (a mask or a shift) and see below"
            )
        read = any(p.name == "jacobian" and p.ran for p in report.probes)
        smooth = sorted({t for p in report.probes if p.name == "jacobian" for t in p.smooth_positions})
        detached = bool(discrete and not continuous and smooth) and not any(
            p.jump_positions for p in report.probes if p.name == "jacobian"
        )
        routed = bool(discrete and (report.mechanisms or not continuous or beyond)) and not (
            detached and not report.mechanisms
        )
        if routed and unrouted and not report.mechanisms:  # routing advice only where something routes
            routed = False
            if not continuous:
                out.append(
                    "mechanism: a discrete change: which outputs change depends on later tokens ("
                    + ("no gradient path" if read else "the Jacobian did not run, see below")
                    + f"): look for {choice} and make it per position or over the prefix. {no_router}"
                )
        if detached and not report.mechanisms:
            out.append(
                "mechanism: later inputs move the output at t continuously, with no gradient path (outputs at "
                f"positions {_ranges(smooth)} change smoothly along a straight path of inputs to another future, "
                "without a jump): a statistic of later positions computed without gradient (under torch.no_grad() "
                "or .detach(): a mean, a norm or a scale over the sequence), not a choice of tokens; compute it "
                "over the prefix (a cumulative statistic) or per token"
            )
        if discrete and report.mechanisms:
            out += [f"mechanism: {_FIX[m]}" for m in report.mechanisms]
        elif routed:
            out.append(
                "mechanism: which tokens are served depends on later tokens (a discrete change"
                + ("" if continuous else ", no gradient path" if read else "; the Jacobian did not run, see below")
                + "; the audit cannot tell how it is routed). If experts or a block pick their top positions: "
                f"{_FIX[EXPERT_CHOICE]}. If tokens pick experts under a capacity: {_FIX[CAPACITY_BY_SCORE]}"
            )
        if routed:
            layers = " or ".join(
                f"moe.MoELayer(d_model, d_ff, num_experts, {_LAYER[m]})" for m in report.mechanisms or _LAYER
            )
            out.append(f"in your own block: {layers} (docs/routers.md)")
    if report.updated_buffers or report.updated_parameters:
        names = [f"{b} (buffer)" for b in report.updated_buffers] + [
            f"{p} (parameter)" for p in report.updated_parameters
        ]
        out.append(
            f"state: its forward updates {', '.join(names)}; the audit restores them before every forward, so "
            "what one call leaves for the next is not counted as a leak (nothing to change)"
        )
    return out


def moved_without_gradient(probes: list) -> list[int]:
    """Output positions that a forward-comparing future probe moved although the Jacobian probe
    of the same mode read no gradient from them to any later input, unless they moved smoothly on
    a straight path of inputs to what moved them, and those that jumped on the Jacobian probe's
    straight paths: a discrete change (a routing decision) where a differentiable path alone
    cannot account for it."""
    out: set[int] = set()
    for jac in probes:
        if jac.name != "jacobian" or not jac.ran:
            continue
        out |= set(jac.jump_positions)
        unread = set(jac.probed_positions) - set(jac.leaking_positions) - set(jac.smooth_positions)
        for p in probes:
            if p.mode == jac.mode and p.kind == "future" and p.compares_forwards and p.leaks:
                out |= unread & set(p.leaking_positions)
    return sorted(out)


OWN_FUTURE_LEAST = 3
"""Fewer (random future, sample) pairs that moved a sample's earlier outputs decide nothing in
:attr:`AuditReport.across_samples_in`."""
KINDS = ("future", "batch", "decode")
"""What a probe's ``leaks`` means. future: an output at position <= t moved when only positions
> t changed; batch: a sample's output moved when only other samples of the batch changed;
decode: the output at t from the prefix 0..t alone differs from the full-sequence one."""
BATCH_PROBE = "batch_interference"
"""The built-in probe of kind "batch"."""
DECODE_PROBE = "decode_consistency"
"""The built-in probe of kind "decode"."""


@dataclass
class ProbeResult:
    """One probe in one mode."""

    name: str
    """The probe's name in the registry (:mod:`moe.audit.probes`)."""
    mode: str
    """"train" or "eval" (the module's training flag while probing)."""
    leaks: bool
    """The probe saw a change beyond the tolerance, or a routing flip."""
    max_abs_delta: float
    """Largest change of a float output where none is allowed; 0.0 for targets without float
    outputs. For ``jacobian``: the largest |sum_f w_f d output[s, f] / d input[r]| over r > s,
    for random signs w (the Jacobian entry itself when features map one to one)."""
    first_leaking_position: int | None
    """Earliest output position that moved (for ``batch_interference``: of the probed samples)."""
    fraction_affected: float
    """Fraction of the probed output positions that moved at least once."""
    kind: str = "future"
    """One of :data:`KINDS`: what ``leaks`` means."""
    compares_forwards: bool = True
    """Judged by comparing forwards (False: the Jacobian, which reads gradients)."""
    leaking_positions: list[int] = field(default_factory=list)
    """Every output position that moved."""
    found_by: str | None = None
    """The first variant that moved an output (e.g. "every sample's future = exact copies of
    x[1, 5]"): how the leak was provoked."""
    routing_flips: int = 0
    """Exact decisions (kept (token, expert) pairs, integer outputs) that changed, summed over trials."""
    tolerance: float = 0.0
    """Relative: a float change counts above ``tolerance`` times the scale of its entry (the larger
    of |before|, |after| and the median |entry| of its output row). Deterministic regime: the
    relative noise floor (the same input run twice) times 10, at least 100 ulp (4 for 16-bit
    outputs). In the distribution regime: the least relative change a permutation test may count."""
    excess: float = 0.0
    """The largest change over its tolerance (above 1: counted, in the distribution regime only
    where the permutation test also finds it significant)."""
    largest_change_by: str | None = None
    """The variant of that largest change."""
    largest_change_p: float | None = None
    """Its permutation-test p-value (None: compared exactly)."""
    comparisons: int = 0
    """How many perturbed forwards (or gradient rows) the probe compared."""
    regime: str = "deterministic"
    """"deterministic" (same seed, same shape, changes beyond the tolerance) or "distribution"
    (some comparisons judged by a permutation test over several seeds)."""
    p_value: float | None = None
    """The smallest permutation-test p-value of the probe's distribution comparisons (None: none)."""
    failed: int = 0
    """Variant forwards the target raised on (or returned something unreadable for)."""
    skipped_lengths: list[int] = field(default_factory=list)
    """Sequence lengths of the failed forwards (the decode probe skips the prefixes it rejects)."""
    errors: list[str] = field(default_factory=list)
    """The first distinct failures, each with its input shape and where the target raised."""
    skipped: str | None = None
    """Why the probe did not run at all on this target (e.g. an integer output has no gradient)."""
    leaking_outputs: list[str] = field(default_factory=list)
    """The outputs that moved (:mod:`moe.audit.target` names; "routing of NAME" for a router's
    hooked decisions)."""
    draws: int = 0
    """The most seeds per input a distribution comparison of this probe drew (0: none)."""
    inconclusive: list[str] = field(default_factory=list)
    """Distribution comparisons whose last stage could neither call the change significant nor
    dismiss it (with their figures): no verdict of "no change" for this probe."""
    screened: int = 0
    """Distribution regime: the variants run once under the audit seed to choose which to test
    (``comparisons`` counts the tests)."""
    changed_share: float | None = None
    """Of the exact entries compared directly (routing decisions, integer and bool outputs: any
    change counts, so ``excess``, a float figure, says nothing of them), the share that changed,
    over all the probe's comparisons; None where none were compared."""
    probed_positions: list[int] = field(default_factory=list)
    """For ``jacobian``: the output positions s whose gradient to the later inputs it read (a
    position among them not in ``leaking_positions`` has none)."""
    note: str | None = None
    """What the reader of its figures must know (the Jacobian's: a gradient the target's own
    backward added, subtracted)."""
    jump_positions: list[int] = field(default_factory=list)
    """For ``jacobian``, where it found a gradient or where a forward probe found a leak it did not:
    the output positions that jump along a straight path from the example to a random future
    (:func:`moe.audit.probes.path_changes`): a discrete change."""
    smooth_positions: list[int] = field(default_factory=list)
    """For ``jacobian``, where a forward probe found a leak it did not: the output positions that
    move smoothly on that path, a statistic of later positions computed without gradient; where it
    found a gradient elsewhere, the positions a forward probe moved without one that move smoothly
    on the path to the variant that moved them: a dependence too weak at the example for its
    gradient to count, no choice."""
    forwards: int = 0
    """Calls of the target this probe made."""
    seconds: float = 0.0
    """Wall time of this probe (forwards, comparisons and building its inputs)."""

    @property
    def ran(self) -> bool:
        """At least one comparison was made (a probe whose every forward failed did not run)."""
        return self.comparisons > 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "kind": self.kind,
            "compares_forwards": self.compares_forwards,
            "leaks": self.leaks,
            "max_abs_delta": _finite(self.max_abs_delta),
            "first_leaking_position": self.first_leaking_position,
            "leaking_positions": self.leaking_positions,
            "found_by": self.found_by,
            "fraction_affected": self.fraction_affected,
            "routing_flips": self.routing_flips,
            "tolerance": _finite(self.tolerance),
            "excess": _finite(self.excess),
            "largest_change_by": self.largest_change_by,
            "largest_change_p": self.largest_change_p,
            "comparisons": self.comparisons,
            "regime": self.regime,
            "p_value": self.p_value,
            "failed": self.failed,
            "skipped_lengths": self.skipped_lengths,
            "errors": self.errors,
            "skipped": self.skipped,
            "leaking_outputs": self.leaking_outputs,
            "draws": self.draws,
            "inconclusive": self.inconclusive,
            "screened": self.screened,
            "changed_share": self.changed_share,
            "probed_positions": self.probed_positions,
            "jump_positions": self.jump_positions,
            "smooth_positions": self.smooth_positions,
            "note": self.note,
            "forwards": self.forwards,
            "seconds": round(self.seconds, 4),
        }


@dataclass
class AuditReport:
    """Everything the audit found about one target."""

    name: str
    modes: tuple[str, ...]
    claims: Claims | None
    """What the target claims (None: an opaque target that claims nothing)."""
    probes: list[ProbeResult] = field(default_factory=list)
    seconds: float = 0.0
    regimes: dict[str, str] = field(default_factory=dict)
    """Per audited mode: "deterministic", "seeded" (random draws, the same for one seed and input
    shape: comparisons across shapes by distribution) or "distribution"
    (:mod:`moe.audit.comparator`)."""
    nonfinite: dict[str, int] = field(default_factory=dict)
    """Per mode: NaN / inf entries in the example's output (compared as values, never ignored)."""
    noise_floors: dict[str, float] = field(default_factory=dict)
    """Per mode: the largest relative change between two forwards of the example under one seed
    (the noise a deterministic comparison is judged against; 0 for a target that repeats itself)."""
    per_comparison_alpha: float | None = None
    """The level of each distribution comparison (Bonferroni over the probes that compare
    forwards, :func:`moe.audit.comparator.per_comparison_alpha`)."""
    test_level: float | None = None
    """The level of each test a distribution comparison makes (its stages of more draws share
    ``per_comparison_alpha``, :data:`moe.audit.comparator.DRAWS`): a p-value at or below it counts."""
    error: str | None = None
    """Why the target could not be audited (in no mode: it failed on the example, two identical
    calls differ because it is stateful; or a forward ran past the time limit, or no
    future-perturbation probe ran); None when it was. With an error, ``leaks`` means nothing."""
    own_future: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per mode that leaks and is not batch-invariant, for a target without claims (judged by a
    fixed seed, :func:`moe.audit.engine._own_future`): ``moved``, the (random future, sample) pairs in which
    resampling every sample's later positions moved that sample's earlier outputs, and
    ``own_alone``, how many of them the sample's own resampled positions alone moved. None of at
    least :data:`OWN_FUTURE_LEAST`: the leak reaches a sample only through the other samples'
    later positions."""
    modes_not_audited: dict[str, str] = field(default_factory=dict)
    """Per mode that could not be audited (the target failed on the example there, or is stateful
    there): why. The other modes were: a leak found in one stands; without one the verdict is
    NOT AUDITED in those modes, never clean."""
    mechanisms: list[str] = field(default_factory=list)
    """Routing mechanisms the target's routers declare for the leaks they claim
    (:func:`moe.audit.report.router_mechanism`); empty for an opaque target."""
    routing_named: list[str] | None = None
    """Its routers, submodules and parameters whose name or class reads as routing (router,
    routed, expert, MoE, mixture, a class ending in Gate, an attribute named gate, w_gate or wg,
    :data:`moe.audit.target.ROUTING_PATH`); None for a callable target (nothing to read): the advice names routers
    only where this is not empty."""
    batch_statistics: dict[str, list[str]] = field(default_factory=dict)
    """Per mode, its BatchNorm layers that normalise with the batch's own statistics there."""
    updated_buffers: list[str] = field(default_factory=list)
    """Buffers the target's forwards change (the audit restores them before every forward: state
    carried from one call to the next, not a leak within a call)."""
    updated_parameters: list[str] = field(default_factory=list)
    """Parameters the target's forwards change in place (a balancing bias kept as a parameter):
    restored before every forward once seen to change, as buffers are."""
    outputs: list[str] = field(default_factory=list)
    """The outputs audited, each with its shape (:mod:`moe.audit.target`)."""
    outputs_not_audited: list[str] = field(default_factory=list)
    """The outputs returned but not compared, each with why (a scalar loss, not per position)."""
    ids_tried: dict[str, list[int]] = field(default_factory=dict)
    """Token inputs: the ids put in futures on purpose, by why (smallest / largest id, named by
    the user, the example's own); uniform random ids are drawn besides."""
    forward_seconds: float = 0.0
    """The unit of the audit's cost: the median time of ``unit_forwards`` plain eval-mode forwards
    of the example under ``torch.no_grad()``, on ``cost_clock``."""
    unit_forwards: int = 0
    """How many forwards ``forward_seconds`` is the median of (0: not measured)."""
    cost_clock: str = "cpu"
    """"cpu": this process's CPU time (a CPU target under one torch thread: a loaded machine does
    not stretch it); "wall": wall time (another device, or several threads)."""
    cost_seconds: float = 0.0
    """The whole audit (every call of the target, with or without gradients, the comparisons,
    building the inputs) on ``cost_clock``."""
    forwards: int = 0
    """Calls of the target the audit made."""
    notes: list[str] = field(default_factory=list)
    """What a reader should know about how the target was read (an output dtype coarser than the
    input's, a flattening order that could not be checked)."""
    quick: bool = False
    """A pre-commit check (half the adversarial cuts): the report says what it left out."""
    sized_from_length: list[str] = field(default_factory=list)
    """The target's routers whose capacity is sized from the length of what they route (a
    prefix alone gets a smaller one): why prefix-only forwards may differ without a leak."""
    agreement: dict[str, dict] | None = None
    """A model target's routing agreement figures (:mod:`moe.agreement`, eval mode): per figure
    (``decode``, ``batch``, ...) the two paths compared and the share of (token, layer) pairs
    routed to the same expert set, or ``{"skipped": why}``; ``{"error": ...}`` if they could not
    be measured; None for other targets (or ``audit(..., agreement=False)``)."""

    @property
    def regime(self) -> str:
        """ "deterministic", "seeded" or "distribution"; "train: ..., eval: ..." where modes differ."""
        kinds = set(self.regimes.values())
        if len(kinds) == 1:
            return kinds.pop()
        return ", ".join(f"{m}: {r}" for m, r in self.regimes.items()) or "none"

    @property
    def forward_equivalents(self) -> float:
        """The audit's time in forwards of the example, on one clock (0 when not measured)."""
        return self.cost_seconds / self.forward_seconds if self.forward_seconds > 0 else 0.0

    @property
    def leaks_in(self) -> list[str]:
        """Modes in which a future probe (random, adversarial, Jacobian) saw a leak."""
        return [m for m in self.modes if any(p.leaks for p in self.probes if p.mode == m and p.kind == "future")]

    @property
    def across_samples_in(self) -> list[str]:
        """Modes whose leak reaches a sample only through the other samples' later positions
        (:attr:`own_future`)."""
        return [m for m, c in self.own_future.items() if c["own_alone"] == 0 and c["moved"] >= OWN_FUTURE_LEAST]

    @property
    def inconclusive_in(self) -> list[str]:
        """Modes without a leak in which a future probe's distribution comparison could neither call
        a change significant nor dismiss it: no verdict there."""
        return [
            m
            for m in self.modes
            if m not in self.leaks_in and any(p.inconclusive for p in self.probes if p.mode == m and p.kind == "future")
        ]

    @property
    def leaks(self) -> bool:
        """An output at position <= t depends on inputs at positions > t, in some mode."""
        return bool(self.leaks_in)

    @property
    def batch_invariant(self) -> bool | None:
        """No sample's output moved when only the other samples changed, in any mode; None where
        no batch probe made a comparison in any mode (every forward of another batch failed): not
        tested, never a vacuous yes."""
        if any(p.leaks for p in self.probes if p.kind == "batch"):
            return False
        return None if len(self.untested("batch")) == len(self.audited_modes) else True

    @property
    def decode_consistent(self) -> bool | None:
        """Prefix-only forwards reproduced the full-sequence outputs in every mode; None where no
        prefix-only forward ran in any mode (the target rejects every shorter length): not tested,
        never a vacuous yes. A router whose capacity is a function of T is decode-inconsistent
        without reading future *content*, so this is reported beside ``leaks``, not inside it."""
        if self.decode_differs_in:
            return False
        return None if len(self.untested("decode")) == len(self.audited_modes) else True

    def untested(self, kind: str) -> list[str]:
        """The audited modes in which no probe of ``kind`` ("batch", "decode") made a comparison."""
        return [m for m in self.audited_modes if not any(p.ran for p in self.probes if p.mode == m and p.kind == kind)]

    @property
    def decode_differs_in(self) -> list[str]:
        """Modes in which a prefix-only forward changed the output at its last position."""
        return [m for m in self.modes if any(p.leaks for p in self.probes if p.mode == m and p.kind == "decode")]

    @property
    def audited_modes(self) -> list[str]:
        """The modes asked for, less those that could not be audited."""
        return [m for m in self.modes if m not in self.modes_not_audited]

    @property
    def claimed_causal(self) -> dict[str, bool] | None:
        """The causal claim per audited mode, or None without claims."""
        if self.claims is None:
            return None
        return {m: self.claims.causal_train if m == "train" else self.claims.causal_eval for m in self.audited_modes}

    @property
    def violations(self) -> list[str]:
        """Claims the audit disproved: causal in a mode where it leaks, batch-invariant where it is not."""
        out = []
        claimed = self.claimed_causal or {}
        for mode in self.leaks_in:
            if claimed.get(mode):
                out.append(f"claims causal in {mode} mode but leaks")
        if self.claims is not None and self.claims.batch_invariant and self.batch_invariant is False:
            out.append("claims batch-invariant but other samples change its outputs")
        if self.claims is not None and self.claims.decode_consistent:
            for mode in self.decode_differs_in:
                if claimed.get(mode):
                    out.append(f"claims decode-consistent in {mode} mode but prefix-only forwards differ")
        return out

    @property
    def unshown(self) -> list[str]:
        """Negative claims (a leak, batch interference, decode inconsistency) the audit did not
        demonstrate. These are false claims too: every claim is checked both ways."""
        out = []
        claimed = self.claimed_causal or {}
        for mode, causal in claimed.items():
            if not causal and mode not in self.leaks_in:
                out.append(f"claims a leak in {mode} mode; none found")
        if self.claims is not None and not self.claims.batch_invariant and self.batch_invariant:
            out.append("claims batch interference; none found")
        if self.claims is not None and not self.claims.decode_consistent and self.decode_consistent:
            out.append("claims decode inconsistency; none found")
        return out

    @property
    def false_claims(self) -> list[str]:
        """Every claim the audit contradicts, both ways: :attr:`violations` then :attr:`unshown`."""
        return self.violations + self.unshown

    @property
    def claims_hold(self) -> bool:
        return not self.false_claims

    @property
    def verdict(self) -> str:
        """NOT AUDITED, FALSE CLAIM, INCONCLUSIVE, claims hold; for a target without claims LEAKS,
        INCONCLUSIVE or clean."""
        if self.error:
            return "NOT AUDITED"
        if self.false_claims:
            return "FALSE CLAIM"
        if self.claims is None and self.leaks:
            return "LEAKS"
        if self.modes_not_audited and not self.leaks:
            return f"NOT AUDITED in {', '.join(self.modes_not_audited)} mode"
        if self.inconclusive_in:
            return "INCONCLUSIVE"
        return "clean" if self.claims is None else "claims hold"

    # -- the summary: a verdict line, then sections ---------------------------------------------
    def summary(self) -> str:
        """What a reader needs once: the verdict and what was audited; on a leak, which probe found
        it at which positions and what to use instead; batch invariance and decode consistency;
        any false claim; how the verdict was reached and on what evidence."""
        if self.error:
            return f"{self.name}: NOT AUDITED: {self.error}"
        lines = [self._verdict_line()]
        for section in (
            self._outputs_section,
            self._findings_section,
            self._batch_decode_section,
            self._claims_section,
            self._advice_section,
            self._evidence_section,
            self._agreement_section,
        ):
            lines += [f"  {line}" for line in section()]
        return "\n".join(lines)

    def _verdict_line(self) -> str:
        if self.leaks:
            found = f"LEAKS in {', '.join(self.leaks_in)} mode"
        elif self.inconclusive_in:
            found = f"INCONCLUSIVE in {', '.join(self.inconclusive_in)} mode (no leak shown, none ruled out)"
        elif self.modes_not_audited:
            found = f"no leak found in {', '.join(self.audited_modes)} mode; {self.verdict}"
        else:
            found = "no leak found"
        claims = "" if self.claims is None or self.verdict.startswith("NOT AUDITED") else f" ({self.verdict})"
        leaking = self.leaking_outputs
        where = (
            f" in {self.outputs[0]}"
            if len(self.outputs) == 1
            else f" in {len(leaking)} of {len(self.outputs)} outputs: {', '.join(leaking)}"
            if leaking
            else f" in {len(self.outputs)} outputs"
            if self.outputs
            else ""
        )
        return f"{self.name}: {found}{claims}{where}"

    @property
    def leaking_outputs(self) -> list[str]:
        """The audited outputs (names, in order) a future probe saw move; a Routing output counts
        by its weights or its kept assignments."""
        moved = {
            o.removesuffix(" (kept assignments)") for p in self.probes if p.kind == "future" for o in p.leaking_outputs
        }
        names = [o.split(" [")[0] for o in self.outputs]
        return [n for n in names if n in moved]

    def _outputs_section(self) -> list[str]:
        out = [f"{mode} mode: NOT AUDITED: {why}" for mode, why in self.modes_not_audited.items()]
        if len(self.outputs) > 1:
            out.append(f"audited: {'; '.join(self.outputs)}")
        if self.outputs_not_audited:
            out.append(f"not audited, with why: {'; '.join(self.outputs_not_audited)}")
        return out + list(self.notes)

    def _findings_section(self) -> list[str]:
        out = []
        many = len(self.outputs) > 1
        for p in self._first_of_each([q for q in self.probes if q.kind == "future" and q.leaks]):
            how = f" ({p.found_by})" if p.found_by else ""
            what = (
                f"{', '.join(p.leaking_outputs)} at positions" if many and p.leaking_outputs else "outputs at positions"
            )
            out.append(f"found by {p.name} ({p.mode}): {what} {_ranges(p.leaking_positions)} moved{how}")
        for mode in self.across_samples_in:
            n = self.own_future[mode]["moved"]
            out.append(
                f"through other samples ({mode}): of the {n} random futures that moved a sample's earlier outputs, "
                "the same future of that sample alone (the other samples as in the example) moved none: its earlier "
                "outputs follow the other samples' later positions, as slots or capacity counted over the flattened "
                "batch, sample after sample, make them (at batched decoding, those positions do not exist yet)"
            )
        for p in self.probes:
            if p.kind == "future" and p.inconclusive and p.mode in self.inconclusive_in:
                out += [
                    f"INCONCLUSIVE: {p.name} ({p.mode}): {text}; a less random instance of the target (its "
                    "dropout off) is judged by a fixed seed instead"
                    for text in p.inconclusive
                ]
        if not self.leaks:
            out += self._not_counted("future")
        return out

    def _batch_decode_section(self) -> list[str]:
        return [f"batch-invariant: {self._batch_text()}", f"decode-consistent: {self._decode_text()}"]

    def _claims_section(self) -> list[str]:
        return [f"FALSE CLAIM: {c}" for c in self.false_claims]

    def _advice_section(self) -> list[str]:
        return advice(self)

    def _evidence_section(self) -> list[str]:
        out = [f"evidence: {self._evidence()}"]
        if self.ids_tried:
            out.append(f"token ids put in futures: {_ids_text(self.ids_tried)}")
        out.append(f"judged: {self._how_judged()}")
        return out + self._probe_notes()

    def _agreement_section(self) -> list[str]:
        """The routing agreement figures of a model target (none when there are none)."""
        if self.agreement is None:
            return []
        if "error" in self.agreement:
            return [f"routing agreement not measured: {self.agreement['error']}"]
        out = ["routing agreement (eval; share of (token, layer) pairs routed to the same expert set):"]
        for name, f in self.agreement.items():
            if "skipped" in f:
                out.append(f"  {name}: not measured: {f['skipped']}")
            else:
                out.append(
                    f"  {name}: {100 * f['share']:.1f}% of {f['pairs']} pairs ({100 * f['tokens_all_layers']:.1f}% of "
                    f"tokens in every layer): {f['reference']} vs {f['compared']}"
                )
        return out

    def _evidence(self) -> str:
        """What was compared, how often, per mode; and the noise it was judged against."""
        per_mode = []
        for mode in self.modes:
            counts = [
                f"{p.name} {p.comparisons}" + (f" (tested, of {p.screened} run once)" if p.screened else "")
                for p in self.probes
                if p.mode == mode and p.ran
            ]
            if counts:
                per_mode.append(f"{mode}: " + ", ".join(counts))
        floors = ", ".join(f"{m} {f:.1e}" for m, f in self.noise_floors.items())
        return (
            "comparisons per probe ("
            + "; ".join(per_mode)
            + "; random futures resample every position after a cut, adversarial ones fill it with copies "
            "and floods, batch ones change the other samples, decode ones cut the sequence)"
            + (f"; the example repeated under one seed moved by at most {floors} of an entry's scale" if floors else "")
        )

    def _probe_notes(self) -> list[str]:
        """Probes' notes, probes that did not run (and why), or whose forwards failed (the first failure)."""
        out = []
        for p in self.probes:
            if p.note:
                out.append(f"{p.name}/{p.mode}: {p.note}")
            if p.skipped:
                out.append(f"{p.name}/{p.mode} did not run: {p.skipped}")
            elif p.errors:
                state = "did not run" if not p.ran else f"{p.failed} forward(s) failed"
                lengths = f" (skipped lengths {p.skipped_lengths})" if p.kind == "decode" and p.skipped_lengths else ""
                out.append(f"{p.name}/{p.mode} {state}{lengths}: {p.errors[0]}")
        return out

    def _not_counted(self, kind: str) -> list[str]:
        """For a kind the audit found nothing of: the largest change that exceeded its tolerance
        but was not significant (distribution regime), so a large number never stands unexplained."""
        over = [p for p in self.probes if p.kind == kind and not p.leaks and p.excess > 1]
        if not over:
            return []
        p = max(over, key=lambda q: q.excess)
        by = f" ({p.largest_change_by})" if p.largest_change_by else ""
        level = f", above the level {self.test_level:.0e} of one test" if self.test_level else ""
        p_text = f"p = {p.largest_change_p:.0e}" if p.largest_change_p is not None else "p unknown"
        draws = f"the {p.draws} seeds drawn per input" if p.draws else "the seeds drawn per input"
        return [
            f"not counted: {p.name} ({p.mode}) changed outputs by up to {p.max_abs_delta:.3g}{by}, not significant "
            f"over {draws} ({p_text}{level}): the target's own randomness explains it as well"
        ]

    @staticmethod
    def _first_of_each(probes: list[ProbeResult]) -> list[ProbeResult]:
        """The first mode's result of each probe name."""
        return list({p.name: p for p in reversed(probes)}.values())[::-1]

    def _untested_why(self, kind: str) -> dict[str, str]:
        """Per audited mode in which a probe of ``kind`` made no comparison: why (its first failure)."""
        out = {}
        for mode in self.untested(kind):
            p = next((q for q in self.probes if q.mode == mode and q.kind == kind), None)
            out[mode] = "it did not run" if p is None else p.skipped or (p.errors[0] if p.errors else "no comparison")
        return out

    def _untested_text(self, kind: str, what: str) -> str:
        """ "not tested: no WHAT ran (mode: why; ...)" where no mode tested ``kind``, else "not
        tested in MODE mode (why)" per mode that did not (none: "")."""
        why = self._untested_why(kind)
        if len(why) == len(self.audited_modes):
            return f"not tested: no {what} ran ({'; '.join(f'{m}: {w}' for m, w in why.items())})"
        return "; ".join(f"not tested in {m} mode ({w})" for m, w in why.items())

    def _skipped_lengths_text(self) -> list[str]:
        """The prefix lengths the decode probe could not run, per mode where it ran others."""
        modes: dict[str, list[str]] = {}  # the same lengths in several modes: one line
        for p in self.probes:
            if p.kind == "decode" and p.ran and p.skipped_lengths:
                modes.setdefault(_ranges(p.skipped_lengths), []).append(p.mode)
        return [f"prefix lengths {lengths} could not run ({', '.join(m)})" for lengths, m in modes.items()]

    def _batch_text(self) -> str:
        if self.batch_invariant is None:
            return self._untested_text("batch", "forward of another batch")
        if self.batch_invariant:
            inconclusive = [
                f"inconclusive: {p.name} ({p.mode}): {p.inconclusive[0]}"
                for p in self.probes
                if p.kind == "batch" and p.inconclusive
            ]
            untested = self._untested_text("batch", "forward of another batch")
            return "; ".join(["yes", *inconclusive[:1], *self._not_counted("batch"), *([untested] if untested else [])])
        p = next(q for q in self.probes if q.kind == "batch" and q.leaks)
        return f"no: {p.name} ({p.mode}) moved the outputs of a sample" + (f" ({p.found_by})" if p.found_by else "")

    def _decode_text(self) -> str:
        untested = self._untested_text("decode", "prefix-only forward")
        if self.decode_consistent is None:
            return untested
        if self.decode_consistent:
            return "; ".join(["yes", *self._skipped_lengths_text(), *([untested] if untested else [])])
        p = next(q for q in self.probes if q.kind == "decode" and q.leaks)
        where = f"prefix-only forwards differ at positions {_ranges(p.leaking_positions)} ({p.mode})"
        if p.mode in self.leaks_in:
            return f"no: {where}; the leak above changes what a prefix sees"
        why = (
            f"the capacity of {', '.join(self.sized_from_length)} is sized from the sequence length T"
            if self.sized_from_length
            else "the outputs depend on the length T, not on what later positions hold (no future probe moved them)"
        )
        return f"no: {where}; not a leak by itself: {why}"

    def _how_judged(self) -> str:
        compared = sum(p.comparisons for p in self.probes)
        ran = sum(p.ran for p in self.probes)
        parts = [f"{ran} probe runs over {', '.join(self.modes)}, {compared} comparisons"]
        regimes = set(self.regimes.values())
        if regimes & {"deterministic", "seeded"}:
            tol = max((p.tolerance for p in self.probes if p.compares_forwards), default=0.0)
            parts.append(
                f"same seed and reset buffers for every forward, a change counts above {tol:.1e} x the scale of "
                "its entry (|before|, |after| or its row's median |entry|) or as any flip of a routing decision"
            )
        if "seeded" in regimes:
            seeded = ", ".join(m for m, r in self.regimes.items() if r == "seeded")
            parts.append(
                f"random in {seeded} mode: the same seed and input shape give the same draws, so inputs of the "
                "example's shape are compared as above, other batch sizes and lengths by distribution"
            )
        dist = [p for p in self.probes if p.p_value is not None]
        if dist:
            draws = max(p.draws for p in dist)
            smallest = min(p.p_value for p in dist if p.p_value is not None)
            parts.append(
                f"{sum(p.comparisons for p in dist if p.regime == 'distribution')} comparisons by permutation tests over "
                f"up to {draws} seeds per input (level {self.test_level or 0:.0e} each, smallest p {smallest:.0e})"
            )
        nonfinite = sum(self.nonfinite.values())
        if nonfinite:
            parts.append(f"{nonfinite} NaN/inf output entries compared as values")
        if self.quick:
            parts.append(
                "quick check: half the adversarial cuts" + ("" if "train" in self.modes else ", eval mode only")
            )
        cost = f"{self.seconds:.2g} s"
        if self.forward_seconds > 0:
            clock = "CPU time" if self.cost_clock == "cpu" else "wall time"
            cost += (
                f", {self.forwards} forwards, {self.forward_equivalents:.0f} forward-equivalents (the audit's {clock} "
                f"over one eval forward of the example, {1e3 * self.forward_seconds:.2g} ms, the median of "
                f"{self.unit_forwards})"
            )
        return f"{self.regime} regime; " + "; ".join(parts) + f"; {cost}"

    @property
    def max_abs_delta(self) -> float:
        """Worst float change at positions <= t from perturbing positions > t (random or adversarial)."""
        return max((p.max_abs_delta for p in self._forward_future_probes), default=0.0)

    @property
    def routing_flips(self) -> int:
        """Routing decisions at positions <= t flipped by perturbing positions > t."""
        return sum(p.routing_flips for p in self._forward_future_probes)

    @property
    def _forward_future_probes(self) -> list[ProbeResult]:
        return [p for p in self.probes if p.kind == "future" and p.compares_forwards]

    def probe(self, name: str, mode: str) -> ProbeResult | None:
        return next((p for p in self.probes if p.name == name and p.mode == mode), None)

    def to_dict(self) -> dict:
        claimed = self.claimed_causal
        return {
            "name": self.name,
            "error": self.error,
            "regime": self.regime,
            "regimes": self.regimes,
            "nonfinite": self.nonfinite,
            "noise_floors": self.noise_floors,
            "per_comparison_alpha": self.per_comparison_alpha,
            "test_level": self.test_level,
            "claimed_causal": None if claimed is None else all(claimed.values()),
            "claimed_causal_in": None if claimed is None else [m for m, c in claimed.items() if c],
            "claimed_batch_invariant": None if self.claims is None else self.claims.batch_invariant,
            "claimed_decode_consistent": None if self.claims is None else self.claims.decode_consistent,
            "modes_not_audited": self.modes_not_audited,
            "own_future": self.own_future,
            "leaks": None if self.error else self.leaks,
            "leaks_in": self.leaks_in,
            "inconclusive_in": self.inconclusive_in,
            "verdict": self.verdict,
            "batch_invariant": self.batch_invariant,
            "decode_consistent": self.decode_consistent,
            "claims_hold": self.claims_hold,
            "violations": self.violations,
            "unshown": self.unshown,
            "max_abs_delta": _finite(self.max_abs_delta),
            "routing_flips": self.routing_flips,
            "mechanisms": self.mechanisms,
            "updated_buffers": self.updated_buffers,
            "updated_parameters": self.updated_parameters,
            "outputs": self.outputs,
            "outputs_not_audited": self.outputs_not_audited,
            "ids_tried": self.ids_tried,
            "notes": self.notes,
            "quick": self.quick,
            "sized_from_length": self.sized_from_length,
            "agreement": self.agreement,
            "seconds": round(self.seconds, 4),
            "forwards": self.forwards,
            "forward_seconds": self.forward_seconds,
            "unit_forwards": self.unit_forwards,
            "cost_clock": self.cost_clock,
            "forward_equivalents": round(self.forward_equivalents, 1),
            "probes": [p.to_dict() for p in self.probes],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``{"targets": [this report]}``, the format ``moe-audit --json`` writes."""
        return reports_to_json([self], indent=indent)

    def table(self) -> str:
        """A per-probe table of this report (rows: probe x mode)."""
        many = len(self.outputs) > 1
        head = ("probe", "mode", "found", "max |delta|", "first pos", "affected", "flips", "tolerance", "regime")
        head += ("outputs moved",) if many else ()
        rows = []
        for p in self.probes:
            found = (
                _LEAK_WORD[p.kind] if p.leaks else ("INCONCLUSIVE" if p.inconclusive else "-" if p.ran else "not run")
            )
            row = (
                p.name,
                p.mode,
                found,
                f"{p.max_abs_delta:.2e}",
                "-" if p.first_leaking_position is None else str(p.first_leaking_position),
                f"{p.fraction_affected:.0%}",
                str(p.routing_flips),
                f"{p.tolerance:.1e}",
                _REGIME_SHORT.get(p.regime, p.regime) + ("" if p.p_value is None else f" p={p.p_value:.0e}"),
            )
            rows.append(row + ((", ".join(p.leaking_outputs) or "-",) if many else ()))
        if self.error:  # no verdict to head the table with
            summary = f"{self.name}: NOT AUDITED: {self.error}"
        else:
            summary = (
                f"{self.name}: leaks in {', '.join(self.leaks_in) or 'no mode'}; "
                f"batch-invariant: {yes_no(self.batch_invariant)}; decode-consistent: {yes_no(self.decode_consistent)}"
                f"; regime: {self.regime}"
            )
            if self.inconclusive_in:
                summary += f"; INCONCLUSIVE in {', '.join(self.inconclusive_in)}"
            for mode, why in self.modes_not_audited.items():
                summary += f"; NOT AUDITED in {mode}: {why}"
        if self.false_claims:
            summary += "\nFALSE CLAIMS: " + "; ".join(self.false_claims)
        return "\n".join([summary, *self._probe_notes(), format_table(head, rows)])


def reports_to_json(reports: list[AuditReport], indent: int | None = 2) -> str:
    return json.dumps({"targets": [r.to_dict() for r in reports]}, indent=indent)


def _ids_text(ids: dict[str, list[int]]) -> str:
    """e.g. "0 (smallest), 255 (largest), 2 (named), 41 of the example's own"."""
    parts = []
    for why, values in ids.items():
        if len(values) <= 6:
            parts.append(f"{', '.join(map(str, values))} ({why})")
        else:
            parts.append(f"{len(values)} ids ({why}: {', '.join(map(str, values[:4]))}, ...)")
    return "; ".join(parts) + "; and uniform random ids"


_REGIME_SHORT = {"deterministic": "det", "seeded": "seeded", "distribution": "dist"}
"""The per-probe table's regime column (the summary line above it spells the regime out)."""
_LEAK_WORD = {"future": "LEAKS", "batch": "MIXES", "decode": "DIFFERS"}
"""What the per-probe table prints for a probe that saw a change, by kind."""


def _ranges(positions: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out: list[str] = []
    for i, q in enumerate(positions):
        if i and q == positions[i - 1] + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{q}"
        else:
            out.append(str(q))
    return ", ".join(out)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


SUMMARY_LEGEND = (
    "causal claim: what the target claims (train only / eval only: causal in that mode); ? = it claims "
    "nothing (an opaque module: only leaks count). batch-inv, decode: claimed/found; decode in the modes the "
    "claim covers, i.e. those claimed causal ((eval): the claim and the finding are eval mode's). verdict: "
    "claims hold, FALSE CLAIM (either way), INCONCLUSIVE, NOT AUDITED; for opaque targets LEAKS or clean."
)
"""Printed under :func:`summary_table`: what its columns and marks mean."""


def summary_table(reports: list[AuditReport]) -> str:
    """One row per target: what it claims, what the audit found, and the verdict (at most
    about 100 columns for the built-in suite's names)."""
    head = ("target", "causal claim", "leaks in", "batch-inv", "decode", "verdict")
    rows = []
    for r in reports:
        claims = r.claims
        rows.append(
            (
                r.name,
                _claimed(r.claimed_causal),
                ",".join(r.leaks_in) or "-",
                f"{'?' if claims is None else yes_no(claims.batch_invariant)}/{_found(r, r.batch_invariant, 'yes', 'no')}",
                _decode_cell(r),
                r.verdict,
            )
        )
    return format_table(head, rows)


def _decode_cell(r: AuditReport) -> str:
    """claimed/found, in the modes the decode claim covers: a router causal only in eval claims
    decode consistency in eval, so "yes/same (eval)" where its training mode differs."""
    claimed = r.claimed_causal
    if r.claims is None or claimed is None:
        return f"?/{_found(r, r.decode_consistent, 'same', 'differs')}"
    covered = [m for m, c in claimed.items() if c] if r.claims.decode_consistent else list(r.modes)
    covered = covered or list(r.modes)
    consistent = (
        False
        if any(m in r.decode_differs_in for m in covered)
        else None
        if all(m in r.untested("decode") for m in covered)
        else True
    )
    found = _found(r, consistent, "same", "differs")
    only = f" ({','.join(covered)})" if len(covered) < len(r.modes) else ""
    return f"{yes_no(r.claims.decode_consistent)}/{found}{only}"


def _found(r: AuditReport, holds: bool | None, yes: str, no: str) -> str:
    """A summary cell's finding: ``yes`` / ``no``, "untested" (None), "-" for a target not audited."""
    return "-" if r.error else "untested" if holds is None else yes if holds else no


def _claimed(claimed: dict[str, bool] | None) -> str:
    if claimed is None:
        return "?"
    if all(claimed.values()):
        return "yes"
    if not any(claimed.values()):
        return "no"
    return " ".join(f"{m} only" for m, c in claimed.items() if c)
