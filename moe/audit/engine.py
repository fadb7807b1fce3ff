"""``audit()`` and ``assert_causal()``: one target, each mode in turn, every registered probe
judged by one comparator; the assertion a project's tests call.

The routing agreement figures of a model target (:mod:`moe.agreement`), as the report keeps them.

``audit()``: one target, each mode in turn, every registered probe judged by one comparator.

Within a mode: :func:`~moe.audit.comparator.calibrate` measures the example's noise and picks
the regime (deterministic, seeded or distribution); in the first mode the order of any
[B * T, ...] output is told (:func:`~moe.audit.probes.check_flat_order`); the probes of kind "batch" run
(separate forwards); then, if none of them found interference and the target claims (or is
opaque about) batch invariance and repeats itself exactly in a doubled batch, perturbed copies
share forwards, in packs sized by :mod:`moe.audit.comparator`; then the other probes in
registration order (:mod:`moe.audit.probes`). A target judged by a fixed seed found to draw
data-dependent noise midway is audited again from the start of the mode by distribution.

Before every forward the runner resets the target's buffers and seeds its generators; a forward
of the example's shape (or a shorter one) that runs past ``forward_timeout`` stops the audit of
the target (NOT AUDITED, with that reason; a pack of copies that does is re-run copy by copy).
A mode in which the target fails on the example, or whose identical calls differ because its
forward changes attributes outside its buffers (:attr:`~moe.audit.comparator.Calibration.stateful`),
is not audited (``AuditReport.modes_not_audited``, with why) and the other modes still are: a
leak found there stands; with no mode audited the target is NOT AUDITED.

``assert_causal``: the audit as one assertion in a project's own tests.

    from moe.audit import assert_causal

    def test_my_block_is_causal():
        assert_causal(MyBlock(), torch.randn(4, 32, 64))   # raises CausalityError with the report

It raises :class:`CausalityError`, an ``AssertionError`` (pytest shows it as a failed assertion,
with the report's summary and per-probe table as the message), when the audit finds a leak, is
INCONCLUSIVE in a mode, cannot run the target, finds a claim of the target false, or (when asked)
finds batch interference or a prefix that decodes differently. Otherwise it returns the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moe.agreement import agreement_figures
from moe.audit import watchdog
from moe.audit.comparator import (
    DRAWS,
    Calibration,
    Comparator,
    Misaligned,
    Tally,
    calibrate,
    difference,
    per_comparison_alpha,
    resolution_of,
)
from moe.audit.probes import (
    Probe,
    ProbeContext,
    Sampler,
    calibration_inputs,
    check_flat_order,
    check_lengths,
    path_changes,
    random_future,
    registered_probes,
)
from moe.audit.report import AuditReport, ProbeResult, router_mechanism
from moe.audit.runner import Runner, TargetExit, TargetFailure, TargetTimeout, cost_clock
from moe.audit.target import AuditTarget, AuditUsageError, Outputs


def target_agreement(at: AuditTarget, example: Tensor) -> dict[str, dict] | None:
    """Per figure of :func:`moe.agreement.agreement_figures` on the example's token ids: its
    ``Agreement.to_dict()``, or ``{"skipped": why}``; ``{"error": ...}`` if the figures could not
    be measured. None for a target that is not a model (float input, no router of this package)."""
    if at.module is None or example.is_floating_point() or not at.routers:
        return None

    def forward(model: nn.Module, idx_BT: Tensor) -> object:
        return model(input_ids=idx_BT) if at.ids_by_keyword else model(idx_BT)

    try:
        figures = agreement_figures(at.module, example, forward=forward)
    except Exception as e:  # the target's own failure: reported, never raised
        return {"error": f"{type(e).__name__}: {e}"}
    return {name: {"skipped": f} if isinstance(f, str) else f.to_dict() for name, f in figures.items()}


MODES = ("train", "eval")
QUICK_MODES = ("eval",)
"""The modes of a quick audit (``quick=True``, ``moe-audit --quick``) unless given."""
TRIALS = 2
"""Random futures per cut position (one in a quick audit) unless given."""
UNIT_FORWARDS = 7
"""Forwards of the example timed for the unit of the audit's cost (their median)."""
FORWARD_TIMEOUT_S = 60.0
"""Default limit on one forward of the target, in seconds (``moe-audit --forward-timeout``)."""


def audit(
    target: Callable[[Tensor], Any],
    example: Tensor,
    *,
    modes: tuple[str, ...] | list[str] | None = None,
    trials: int | None = None,
    seed: int = 0,
    name: str | None = None,
    vocab_size: int | None = None,
    output: str | None = None,
    special_ids: tuple[int, ...] | list[int] = (),
    probes: tuple[Probe, ...] | list[Probe] | None = None,
    forward_timeout: float | None = FORWARD_TIMEOUT_S,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    agreement: bool = True,
) -> AuditReport:
    """Audit ``target`` on inputs shaped like ``example`` and return an :class:`AuditReport`.

    ``target``: an ``nn.Module`` or callable mapping [B, T, ...] (float features or int64 token
    ids; a forward with an ``input_ids`` parameter gets them by that keyword) to [B, T, ...]: a
    tensor, a :class:`~moe.routing.Routing` (compared through ``dense()`` and exactly through
    ``mask()``), or a tuple / dict / dataclass (``ModelOutput``) holding one: the field
    every [B, T, ...] tensor (and [B * T, ...] one) it holds, each by name (:mod:`moe.audit.target`;
    ``output``: comma-separated names to audit instead).
    ``example``: the input the probes perturb (B >= 1, T >= 2), on the target's device and in
    its dtype. ``trials``: random perturbations per cut position. ``vocab_size``: the id range
    resampled for token inputs (default: the first ``nn.Embedding`` of the target, else
    ``example.max() + 1``). ``special_ids``: token ids the target treats specially (an
    end-of-document id, padding), put in futures besides the smallest and largest ids and the
    example's own. ``probes``: the probes to run (default: every registered one,
    :func:`~moe.audit.probes.registered_probes`); the distribution regime's per-comparison
    level is derived from those that compare forwards. ``forward_timeout``: seconds one forward
    may take (None: no limit; enforced in the main thread on POSIX, see :mod:`moe.audit.runner`);
    past it the target is not audited. ``quick``: a pre-commit check: half the adversarial cut
    positions and, unless given, eval mode only and one random future per cut (a leak of training
    mode only is then not looked for). ``modes`` default to both, ``trials`` to 2.
    ``progress``: called with one line per probe run. ``agreement``: for a model target (token ids
    in, this package's routers inside), also measure the routing agreement figures
    (:mod:`moe.agreement`) into ``report.agreement``.

    Train mode runs the target as a training step does: ``module.train()`` with gradients
    enabled and a float input that requires them; eval mode: ``module.eval()`` under
    ``torch.no_grad()``. Before every forward, its buffers are restored and its generators seeded.

    Raises :class:`AuditUsageError` for bad arguments only; whatever the target does (raise,
    return something unreadable) ends up in the report (``error``, or a probe's ``errors``).
    Afterwards the target's parameters, buffers (persistent or not), its own generators and
    training flags are as before, and so are torch's, Python's and NumPy's random generators.
    """
    start = time.perf_counter()
    modes = tuple(modes) if modes is not None else (QUICK_MODES if quick else MODES)
    trials = trials if trials is not None else (1 if quick else TRIALS)
    suite = _check_arguments(modes, trials, example, probes)
    if forward_timeout is not None and not forward_timeout > 0:
        raise AuditUsageError(f"forward_timeout must be a positive number of seconds or None, got {forward_timeout!r}")
    clock = cost_clock(example)
    clock_start = clock()
    at = AuditTarget(target, output=output)
    sampler = Sampler(example, vocab_size if vocab_size is not None else _vocab_size(at, example), special_ids)
    alpha = per_comparison_alpha(sum(p.compares_forwards for p in suite))
    report = AuditReport(
        name=name or _name_of(target),
        modes=modes,
        claims=at.claims,
        per_comparison_alpha=alpha,
        test_level=alpha / len(DRAWS),
        quick=quick,
    )
    report.mechanisms = _mechanisms(at, modes)
    report.routing_named = at.routing_named()
    report.batch_statistics = {m: at.batch_statistics(m) for m in modes}
    report.sized_from_length = [  # what its routers declare: capacities sized from the group's length
        at.router_name(r)
        for r in at.routers
        if getattr(r, "capacity_factor", None) is not None and getattr(r, "capacity_scope", "group") != "prefix"
    ]
    runner = Runner(at, seed, forward_timeout, report.name)
    session = _Session(runner, sampler, trials, seed, suite, alpha, progress, start)
    with _rng_preserved(), at.state.preserved():
        unit_before = _one_forward_seconds(runner, at, example)
        for mode in modes:  # a mode that cannot be audited is reported, the others still are
            at.set_mode(mode)
            try:
                why = _audit_one_mode(session, report, example, mode)
            except (TargetTimeout, TargetExit) as e:  # the time limit and sys.exit stop the whole audit
                report.error = _stopped(e, mode)
                break
            except TargetFailure as e:
                why = f"the target failed on the example in {mode} mode ({e})"
            if why is not None:
                report.modes_not_audited[mode] = why
        if report.error is None and len(report.modes_not_audited) == len(modes):
            report.error = "; ".join(report.modes_not_audited.values())
        _after_modes(session, at, report, example, agreement, unit_before)
    if report.error is None and not any(p.ran for p in report.probes if p.kind == "future" and p.compares_forwards):
        failures = [e for p in report.probes for e in p.errors]
        report.error = "no future-perturbation probe ran" + (f": {failures[0]}" if failures else "")
    report.notes += _dtype_notes(example, at)
    report.forwards = runner.cost.forwards
    report.seconds = time.perf_counter() - start
    report.cost_seconds = clock() - clock_start
    report.cost_clock = "cpu" if clock is time.process_time else "wall"
    return report


def _check_arguments(modes: tuple[str, ...], trials: int, example: object, probes: object) -> tuple[Probe, ...]:
    for m in modes:
        if m not in MODES:
            raise AuditUsageError(f"unknown mode {m!r}; modes are 'train' and 'eval'")
    if not modes:
        raise AuditUsageError("at least one mode is needed")
    if not isinstance(trials, int) or trials < 1:
        raise AuditUsageError(f"trials must be a positive integer, got {trials!r}")
    if not isinstance(example, Tensor):
        raise AuditUsageError(f"the example input must be a torch.Tensor, got {type(example).__name__}")
    suite = registered_probes() if probes is None else tuple(probes)
    if not all(isinstance(p, Probe) for p in suite):
        raise AuditUsageError(f"probes must be moe.audit.probes.Probe objects, got {[type(p).__name__ for p in suite]}")
    names = [p.name for p in suite]
    if len(set(names)) != len(names):
        raise AuditUsageError(f"probe names must be unique, got {names}")
    if not any(p.kind == "future" and p.compares_forwards for p in suite):
        raise AuditUsageError(f"at least one probe of kind 'future' with variants is needed, got {names}")
    return suite


@dataclass
class _Session:
    """What every mode of one audit shares."""

    runner: Runner
    sampler: Sampler
    trials: int
    seed: int
    suite: tuple[Probe, ...]
    alpha: float
    progress: Callable[[str], None] | None
    start: float
    tallies: dict[tuple[str, str], tuple[Comparator, Tally]] = field(default_factory=dict)
    """Per (mode, probe name) of a probe with variants: its comparator and tally (the last run)."""
    listed: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    """Per mode calibrated: the outputs its example's forward gave to audit, and those not, with why."""


def _listed_over_modes(listed: dict[str, tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    """The outputs audited and those not, over the modes: an entry that some mode does not give
    says in which mode it was seen (an auxiliary loss returned in training only: "3 [] (not per
    position ...) in train mode", beside "3 (None: nothing returned in it) in eval mode")."""
    merged: list[list[str]] = []
    for k in (0, 1):
        entries = dict.fromkeys(e for lists in listed.values() for e in lists[k])
        merged.append(
            [
                e
                if all(e in lists[k] for lists in listed.values())
                else f"{e} in {', '.join(m for m, lists in listed.items() if e in lists[k])} mode"
                for e in entries
            ]
        )
    return merged[0], merged[1]


def _audit_one_mode(session: _Session, report: AuditReport, example: Tensor, mode: str) -> str | None:
    """Calibrate, then run every probe of ``mode`` into ``report``; the reason the target cannot
    be audited, or None. Raises :class:`TargetTimeout` from any forward past the time limit."""
    runner = session.runner
    probes_x = calibration_inputs(example, session.sampler, session.seed)
    try:
        cal = calibrate(runner, example, probes_x)
        if mode == report.modes[0] and check_lengths(runner, example, cal.base.out):
            cal = calibrate(runner, example, probes_x)  # read again without the outputs that do not follow T
        if runner.target.flat_fields and mode == report.modes[0]:
            report.notes += check_flat_order(runner, example, cal.base.out, session.sampler, session.seed)
            if runner.target.time_major:  # read again in the order found
                cal = calibrate(runner, example, probes_x)
    except TargetFailure as e:
        what = "its output breaks the audit's contract" if isinstance(e.error, AuditUsageError) else "the target failed"
        return f"{what} on the example in {mode} mode ({e})"
    report.nonfinite[mode] = cal.nonfinite
    report.noise_floors[mode] = cal.floor
    session.listed[mode] = (list(runner.target.audited), [s.text() for s in runner.target.not_audited])
    report.outputs, report.outputs_not_audited = _listed_over_modes(session.listed)
    if not cal.comparable:
        return f"nothing to compare in {mode} mode: all {cal.nonfinite} entries of the example's output are NaN or inf"
    if cal.stateful:
        return f"{cal.stateful} in {mode} mode"
    report.updated_buffers += [b for b in cal.updated_buffers if b not in report.updated_buffers]
    report.updated_parameters += [p for p in cal.updated_parameters if p not in report.updated_parameters]
    ctx = _context(session, example, mode, cal, report.quick)
    comparator = Comparator(runner, example, mode, cal, session.alpha)
    try:
        results = _run_probes(comparator, ctx, session)
    except Misaligned:
        cal = cal.by_distribution()
        ctx.regime, ctx.repeat_tolerance = cal.regime, None
        comparator = Comparator(runner, example, mode, cal, session.alpha)
        results = _run_probes(comparator, ctx, session)
    if comparator.unpacked:
        report.notes.append(f"{mode} mode: perturbed copies stopped sharing forwards: {comparator.unpacked}")
    _read_the_path(ctx, results, session.tallies)
    report.probes += results
    report.regimes[mode] = cal.regime
    if ctx.sampler.tokens:
        report.ids_tried = ctx.ids_tried
    return None


def _context(session: _Session, example: Tensor, mode: str, cal: Calibration, quick: bool) -> ProbeContext:
    """What the probes see of ``mode`` as ``cal`` measured it: its tolerances where the example
    repeats itself under one seed (None in the distribution regime)."""
    repeats = cal.tolerances if cal.regime != "distribution" else None
    return ProbeContext(
        session.runner.target,
        session.runner,
        example,
        session.sampler,
        session.trials,
        session.seed,
        mode,
        cal.base.out,
        repeats,
        cal.regime,
        quick,
    )


def _read_the_path(ctx: ProbeContext, results: list[ProbeResult], tallies: dict) -> None:
    """Where a forward probe moved earlier outputs and the Jacobian read no gradient to later
    inputs, how the outputs move on a straight path to another future
    (:func:`~moe.audit.probes.path_changes`): jumps are a discrete change (a choice of tokens),
    smooth moves a statistic computed without gradient; into the Jacobian's result. Where the
    Jacobian read a gradient elsewhere, each position a forward probe moved without one is read
    on the path to the first variant that moved it: a smooth move there is a dependence too weak
    at the example for its gradient to count (zoology's Nystrom attention reads the future at
    position 0 through its iterative pseudo-inverse, a gradient of 6e-9), no choice."""
    jacobian = next((r for r in results if r.name == "jacobian" and r.ran), None)
    moved = [r for r in results if r.kind == "future" and r.compares_forwards and r.leaks]
    if jacobian is None or not moved:
        return
    if not jacobian.leaks:
        jacobian.jump_positions, jacobian.smooth_positions = path_changes(ctx)
        return
    unread = set(jacobian.probed_positions) - set(jacobian.leaking_positions)
    variants = {}  # the first variant that moved each unread position, by its identity
    for result in moved:
        tally = tallies[(ctx.mode, result.name)][1]
        for position in sorted(unread & set(result.leaking_positions)):
            variant = tally.moved_by.get(position)
            if variant is not None and variant.x.shape == ctx.x.shape:
                variants.setdefault(id(variant), (variant, set()))[1].add(position)
    for variant, positions in variants.values():
        jumps, smooth = path_changes(ctx, variant)
        jacobian.jump_positions = sorted(set(jacobian.jump_positions) | (positions & set(jumps)))
        jacobian.smooth_positions = sorted(set(jacobian.smooth_positions) | (positions & set(smooth)))


def _run_probes(comparator: Comparator, ctx: ProbeContext, session: _Session) -> list[ProbeResult]:
    suite = session.suite
    results: dict[str, ProbeResult | None] = {
        p.name: _run(p, comparator, ctx, session) for p in suite if p.kind == "batch"
    }
    batch = [r for r in results.values() if r is not None and r.ran]
    claims = ctx.at.claims
    if batch and not any(r.leaks for r in batch) and (claims is None or claims.batch_invariant):
        comparator.allow_batching()
    for p in suite:
        if p.name not in results:
            results[p.name] = _run(p, comparator, ctx, session)
    return [r for r in (results[p.name] for p in suite) if r is not None]


def _run(probe: Probe, comparator: Comparator, ctx: ProbeContext, session: _Session) -> ProbeResult | None:
    began, forwards = time.perf_counter(), session.runner.cost.forwards
    if probe.measure is not None:
        result = probe.measure(ctx)
    else:
        tally = comparator.tally(probe.name, probe.kind)
        session.tallies[(ctx.mode, probe.name)] = (comparator, tally)
        result = comparator.judge(probe.variants(ctx), tally, probe.stop_at_first, probe.enough)
    if result is not None:
        result.forwards = session.runner.cost.forwards - forwards
        result.seconds = time.perf_counter() - began
        if result.leaks:  # kept by moe-audit's watchdog, for a later forward it must stop
            watchdog.found(session.runner.name, result.kind, ctx.mode, probe.name)
    if session.progress is not None:
        now = time.perf_counter()
        found = "not run" if result is None or not result.ran else ("change found" if result.leaks else "nothing found")
        session.progress(
            f"{probe.name} ({ctx.mode}): {found} in {now - began:.1f} s ({now - session.start:.0f} s so far)"
        )
    return result


def _after_modes(
    session: _Session, at: AuditTarget, report: AuditReport, example: Tensor, agreement: bool, unit_before: float
) -> None:
    """Once every mode ran: the variants that leaked in one mode retested in the others, the
    unit of the cost measured again (the smaller of that and ``unit_before``, measured before the
    modes, is kept: a slow spell on a loaded machine during one of them decides nothing), and a
    model's routing agreement figures (if asked)."""
    if report.error is None:
        _confirm_across_modes(session, at, report)
    if report.error is None:
        _own_future(session, at, report, example)
    for mode in [m for m, regime in report.regimes.items() if regime != "deterministic"]:
        if report.error is None:
            at.set_mode(mode)
            _with_fixed_draws(session, report, example, mode)
    if report.error is None:
        units = [u for u in (unit_before, _one_forward_seconds(session.runner, at, example)) if u > 0]
        report.forward_seconds = min(units, default=0.0)
        report.unit_forwards = UNIT_FORWARDS if units else 0
    if agreement and report.error is None:
        report.agreement = target_agreement(at, example)


FIXED_AT: tuple[tuple[float | tuple[float, float], str], ...] = (
    (0.5, "their medians"),
    (0.25, "their lower quartiles"),
    (0.75, "their upper quartiles"),
    ((0.75, 0.25), "their upper and lower quartiles in turn"),
    ((0.25, 0.75), "their lower and upper quartiles in turn"),
)
"""Where :func:`_with_fixed_draws` fixes the draws, pass by pass: each law's median, its
quartiles, then a call's draws at its two quartiles in turn (both orders; only for a target that
draws more than once a call) (:class:`~moe.audit.fixed_draws.FixedDraws`)."""


def _with_fixed_draws(session: _Session, report: AuditReport, example: Tensor, mode: str) -> None:
    """A mode judged by its noise, audited again with every random draw of torch fixed at its
    median (:mod:`moe.audit.fixed_draws`), then at its lower and at its upper quartile, then (for
    a target that draws more than once a call) with a call's draws at the two quartiles in turn:
    its rule, deterministic then, is judged by a fixed seed, and what that finds of a kind (a
    leak, batch interference, a prefix that differs) where the noisy audit and the passes before
    found none of it is added to ``report.probes`` (the probe's name and the variant say so).
    Noise can hide a leak of the rule below any test of a few dozen draws (a random choice among
    an overfull expert's tokens behind a sampled gate); the draws fixed, it shows in every
    comparison. A branch the rule takes only away from the median (fairseq's ``Top2Gate`` keeps a
    random second expert where ``2 p > U``, and the capacity it crowds overflows only when most
    are kept) shows at a quartile; one it takes only where two draws differ (zoology's
    ``BigBIRDAttention`` keeps a random pair of positions (i, j) where i > j), with the draws in
    turn. Nothing is added where the draws could not all be fixed (an op the mode does not know,
    Python's or NumPy's generators), the target fails with them fixed, or, with the draws in
    turn, its calls draw other ops (or in another order) for other inputs."""
    found, kinds = {p.kind for p in report.probes if p.mode == mode and p.leaks}, {p.kind for p in session.suite}
    if found >= kinds:
        return
    comparisons, runs, added, done, draws = 0, 0, [], [], 0
    for quantile, where in FIXED_AT:
        if not isinstance(quantile, float) and draws < 2:
            break  # one draw a call: in turn is as at a quartile
        results, why, draws = _fixed_pass(session, report, example, mode, quantile)
        if why is not None:
            report.notes.append(f"{mode} mode: not audited with its random draws fixed at {where}: {why}")
            break
        comparisons, runs = comparisons + sum(r.comparisons for r in results), runs + len(results)
        done.append(where)
        for result in [r for r in results if r.leaks and r.kind not in found]:
            result.name = f"{result.name}, draws fixed"
            variant = f"the target's random draws fixed at {where}"
            result.found_by = f"{result.found_by}, with {variant}" if result.found_by else variant
            report.probes.append(result)
            added.append(result.name)
            found.add(result.kind)
        if found >= kinds:
            break
    if done:
        report.notes.append(
            f"{mode} mode: audited again with its random draws fixed at {', then at '.join(done)}: "
            f"{comparisons} comparisons in {runs} probe runs, found {', '.join(added) or 'nothing the noisy audit had not'}"
        )


def _fixed_pass(
    session: _Session, report: AuditReport, example: Tensor, mode: str, quantile: float | tuple[float, float]
) -> tuple[list[ProbeResult], str | None, int]:
    """The probes run on ``mode`` with every draw fixed at its ``quantile`` (or a call's draws at
    them in turn): (their results, None, the draws of a call), or ([], why the pass could not
    judge the target, the draws of a call)."""
    runner = session.runner
    with runner.drawing_fixed(quantile) as fixed:
        try:
            cal = calibrate(runner, example, calibration_inputs(example, session.sampler, session.seed))
            if cal.regime == "deterministic" and not cal.stateful and cal.comparable:
                alone = dataclasses.replace(session, tallies={})  # the noisy audit's tallies stay as they are
                ctx = _context(alone, example, mode, cal, report.quick)
                results = _run_probes(Comparator(runner, example, mode, cal, session.alpha), ctx, alone)
                if fixed.misaligned and not isinstance(quantile, float):  # draw k is not one op in every call
                    return [], "its calls draw other random ops, or in another order, for other inputs", 0
                return results, None, len(fixed.order or ())
            left = sorted(fixed.unknown) + (["Python's or NumPy's generator"] if runner.last_host_draws else [])
            return [], "its output still varies" + (f" (left drawing: {', '.join(left)})" if left else ""), 0
        except (TargetFailure, TargetTimeout, TargetExit, Misaligned) as e:  # Misaligned: draws that follow the data
            return [], str(e) or "its draws still follow the data", 0


def _one_forward_seconds(runner: Runner, at: AuditTarget, example: Tensor) -> float:
    """The median time of one plain eval-mode forward of the example under ``torch.no_grad()``
    (UNIT_FORWARDS of them after one warm-up) on the audit's cost clock, as
    ``experiments/bench_audit.py`` measures its unit (0 if one fails)."""
    at.set_mode("eval")
    try:
        times = [runner.time_forward(example) for _ in range(UNIT_FORWARDS + 1)]
    except (TargetFailure, TargetTimeout, TargetExit):
        return 0.0
    finally:
        at.state.changed_parameters()  # one these forwards moved is restored before every later forward
    return statistics.median(times[1:])


def _confirm_across_modes(session: _Session, at: AuditTarget, report: AuditReport) -> None:
    """A probe that found nothing in a mode judged by distribution, where the same probe moved the
    outputs in another mode: the variant that did it is tested in this mode too, on the last
    stage's draws (the inputs are the same in every mode; a training-mode leak under dropout is
    often too small for the screen to pick out of the noise, but not for 64 draws)."""
    for i, result in enumerate(report.probes):
        entry = session.tallies.get((result.mode, result.name))
        if result.leaks or entry is None or entry[0].cal.regime != "distribution":
            continue
        found = [
            t.found
            for (mode, name), (_, t) in session.tallies.items()
            if name == result.name and mode != result.mode and t.found is not None
        ]
        if not found:
            continue
        comparator, tally = entry
        at.set_mode(result.mode)
        forwards, began = session.runner.cost.forwards, time.perf_counter()
        try:
            confirmed = comparator.confirm(found[0], tally)
        except (TargetTimeout, TargetExit) as e:
            report.error = _stopped(e, result.mode)
            return
        confirmed.forwards = result.forwards + session.runner.cost.forwards - forwards
        confirmed.seconds = result.seconds + time.perf_counter() - began
        report.probes[i] = confirmed


def _own_future(session: _Session, at: AuditTarget, report: AuditReport, example: Tensor) -> None:
    """In each mode that leaks and is not batch-invariant, judged by a fixed seed: the variants of
    :func:`~moe.audit.probes.random_future` again (the same draws, every sample's positions after
    the cut resampled), and for each sample whose earlier outputs one of them moved, the same future of
    that sample alone, the other samples as in the example. ``report.own_future[mode]`` counts
    both (``moved``: the (future, sample) pairs that moved; ``own_alone``: how many of them the
    sample's own future alone moved); with ``own_alone`` 0 of at least ``OWN_FUTURE_LEAST``, the
    leak reaches a sample only through the other samples' later positions. Opaque targets only:
    a target that declares claims (this package's routers, layers and models) has its routers
    name their mechanism."""
    if report.claims is not None:
        return
    for mode in report.leaks_in:
        entry = session.tallies.get((mode, "random_future"))
        batch = any(p.leaks for p in report.probes if p.mode == mode and p.kind == "batch")
        if not batch or entry is None or entry[0].cal.regime == "distribution" or example.shape[0] < 2:
            continue
        cal, moved, own = entry[0].cal, 0, 0
        ctx = _context(session, example, mode, cal, report.quick)
        at.set_mode(mode)
        try:
            for every in random_future(ctx):
                out = session.runner.forward(every.x).out
                for b in range(example.shape[0]):
                    if not _moved(cal, out, every.upto, b):
                        continue
                    alone = example.clone()
                    alone[b, every.upto :] = every.x[b, every.upto :]
                    moved, own = moved + 1, own + _moved(cal, session.runner.forward(alone).out, every.upto, b)
        except TargetFailure:
            continue
        except (TargetTimeout, TargetExit) as e:
            report.error = _stopped(e, mode)
            return
        report.own_future[mode] = {"moved": moved, "own_alone": own}


def _stopped(e: TargetTimeout | TargetExit, mode: str) -> str:
    """``report.error`` for a forward past the time limit or a ``sys.exit``: the audit stops."""
    if isinstance(e, TargetTimeout):
        return f"{e} in {mode} mode (the per-forward time limit, --forward-timeout); the audit stopped"
    return f"{e} in {mode} mode"


def _moved(cal: Calibration, out: Outputs, upto: int, b: int) -> bool:
    """Whether sample ``b``'s outputs at positions < upto differ from the example's beyond the mode's tolerances."""
    _, flips_S, excess_S = difference(cal.base.out, out, upto, (b,), cal.tolerances)
    return bool(flips_S.sum()) or float(excess_S.max()) > 1


def _dtype_notes(example: Tensor, at: AuditTarget) -> list[str]:
    """A float output computed in a coarser dtype than the float input: what it cannot show."""
    if not example.is_floating_point():
        return []
    eps = torch.finfo(example.dtype).eps
    out = []
    for part in at.float_parts:
        if part.dtype is not None and torch.finfo(part.dtype).eps > eps:
            out.append(
                f"{part.name} comes back {_dtype_name(part.dtype)} for a {_dtype_name(example.dtype)} input: a change "
                f"below {resolution_of(part.dtype):.1e} of an entry's scale (the tolerance of {_dtype_name(part.dtype)}) "
                "cannot be seen in it"
            )
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _mechanisms(at: AuditTarget, modes: tuple[str, ...]) -> list[str]:
    """The mechanisms of the target's routers that claim a leak in one of ``modes``."""
    leaky = [
        r for r in at.routers if not all(r.claims.causal_train if m == "train" else r.claims.causal_eval for m in modes)
    ]
    return list(dict.fromkeys(m for m in map(router_mechanism, leaky) if m is not None))


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """The CPU generator, every CUDA generator when CUDA is in use, Python's ``random`` and NumPy's
    global generator (when NumPy is loaded) as they were: the runner seeds them all."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state = random.getstate()
    numpy_random = sys.modules["numpy"].random if "numpy" in sys.modules else None
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


def _vocab_size(at: AuditTarget, example: Tensor) -> int | None:
    if example.is_floating_point():
        return None
    if at.module is not None:
        for m in at.module.modules():
            if isinstance(m, torch.nn.Embedding):
                return m.num_embeddings
    return int(example.max()) + 1


def _name_of(target: Any) -> str:
    return getattr(target, "__name__", None) or type(target).__name__


class CausalityError(AssertionError):
    """The audit found what :func:`assert_causal` asserts against; ``report`` has it all."""

    def __init__(self, message: str, report: AuditReport) -> None:
        super().__init__(message)
        self.report = report


def assert_causal(
    target: Callable[[Tensor], Any],
    example: Tensor,
    *,
    batch_invariant: bool = False,
    decode_consistent: bool = False,
    **audit_options: Any,
) -> AuditReport:
    """Audit ``target`` on ``example`` (:func:`moe.audit.audit`; ``audit_options`` are its
    keyword arguments: ``modes``, ``seed``, ``quick``, ``output``, ``special_ids``, ...) and
    raise :class:`CausalityError` unless it is causal in every audited mode: no leak, no
    INCONCLUSIVE mode, every mode audited, and no false claim. ``batch_invariant`` /
    ``decode_consistent``: also require that no sample's output depends on the other samples /
    that prefix-only forwards reproduce the full-sequence outputs. Returns the report."""
    __tracebackhide__ = True  # pytest shows the report, not this frame
    report = audit(target, example, **audit_options)
    problems = []
    if report.error:
        problems.append(f"NOT AUDITED: {report.error}")
    else:
        problems += [f"NOT AUDITED in {mode} mode: {why}" for mode, why in report.modes_not_audited.items()]
        if report.leaks:
            problems.append(f"leaks in {', '.join(report.leaks_in)} mode")
        if report.inconclusive_in:
            problems.append(f"INCONCLUSIVE in {', '.join(report.inconclusive_in)} mode")
        if batch_invariant and report.batch_invariant is None:
            problems.append("batch invariance not tested: no forward of another batch ran")
        elif batch_invariant and not report.batch_invariant:
            problems.append("not batch-invariant")
        if decode_consistent and report.decode_consistent is None:
            problems.append("decode consistency not tested: no prefix-only forward ran")
        elif decode_consistent and not report.decode_consistent:
            problems.append(f"prefix-only forwards differ in {', '.join(report.decode_differs_in)} mode")
        problems += [f"false claim: {c}" for c in report.false_claims]
    if problems:
        body = report.summary() if report.error else f"{report.summary()}\n\n{report.table()}"
        raise CausalityError(f"{report.name}: {'; '.join(problems)}\n\n{body}", report)
    return report
