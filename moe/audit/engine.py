"""``audit()``: one target, each mode in turn, every registered probe judged by one comparator.

Within a mode: :func:`~moe.audit.calibration.calibrate` measures the example's noise and picks
the regime; the probes of kind "batch" run (separate forwards); then, if none of them found
interference and the target claims (or is opaque about) batch invariance and repeats itself
exactly in a doubled batch, perturbed copies share forwards; then the other probes in
registration order (:mod:`moe.audit.registry`). A deterministic-regime target found to draw
data-dependent noise midway is audited again from the start of the mode by distribution.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

import moe.audit.probes  # noqa: F401  (registers the built-in probes)
from moe.audit.calibration import Calibration, calibrate
from moe.audit.comparator import Comparator, Misaligned, per_comparison_alpha
from moe.audit.context import ProbeContext, Sampler, calibration_inputs
from moe.audit.registry import Probe, registered_probes
from moe.audit.report import AuditReport, ProbeResult
from moe.audit.runner import Runner, TargetFailure
from moe.audit.target import AuditTarget, AuditUsageError

MODES = ("train", "eval")


def audit(
    target: Callable[[Tensor], Any],
    example: Tensor,
    *,
    modes: tuple[str, ...] | list[str] = MODES,
    trials: int = 2,
    seed: int = 0,
    name: str | None = None,
    vocab_size: int | None = None,
    output: str | None = None,
    probes: tuple[Probe, ...] | list[Probe] | None = None,
) -> AuditReport:
    """Audit ``target`` on inputs shaped like ``example`` and return an :class:`AuditReport`.

    ``target``: an ``nn.Module`` or callable mapping [B, T, ...] (float features or int64 token
    ids; a forward with an ``input_ids`` parameter gets them by that keyword) to [B, T, ...]: a
    tensor, a :class:`~moe.routing.Routing` (compared through ``dense()`` and exactly through
    ``mask()``), or a tuple / dict / dataclass (``ModelOutput``) holding one: the field
    ``output`` (a key, attribute or tuple index), else ``logits``, else the first tensor.
    ``example``: the input the probes perturb (B >= 1, T >= 2), on the target's device and in
    its dtype. ``trials``: random perturbations per cut position. ``vocab_size``: the id range
    resampled for token inputs (default: the first ``nn.Embedding`` of the target, else
    ``example.max() + 1``). ``probes``: the probes to run (default: every registered one,
    :func:`~moe.audit.registry.registered_probes`); the distribution regime's per-comparison
    level is derived from those that compare forwards.

    Raises :class:`AuditUsageError` for bad arguments only; whatever the target does (raise,
    return something unreadable) ends up in the report (``error``, or a probe's ``errors``).
    Afterwards the target's parameters, buffers (persistent or not) and training flags are as
    before, and so are the CPU and CUDA random generators.
    """
    start = time.perf_counter()
    modes = tuple(modes)
    suite = _check_arguments(modes, trials, example, probes)
    at = AuditTarget(target, output=output)
    sampler = Sampler(example, vocab_size if vocab_size is not None else _vocab_size(at, example))
    alpha = per_comparison_alpha(sum(p.compares_forwards for p in suite))
    report = AuditReport(name=name or _name_of(target), modes=modes, claims=at.claims, per_comparison_alpha=alpha)
    runner = Runner(at, seed)
    with _rng_preserved(), at.preserved():
        for mode in modes:
            at.set_mode(mode)
            try:
                cal = calibrate(runner, example, calibration_inputs(example, sampler, seed))
            except TargetFailure as e:
                report.error = f"the target failed on the example in {mode} mode ({e})"
                break
            report.nonfinite[mode] = cal.nonfinite
            if not cal.comparable:
                report.error = f"nothing to compare in {mode} mode: all {cal.nonfinite} entries of the example's output are NaN or inf"
                break
            ctx = ProbeContext(at, runner, example, sampler, trials, seed, mode, cal.base.out)
            results, cal = _audit_mode(runner, ctx, cal, suite, alpha)
            report.probes += results
            report.regimes[mode] = cal.regime
    if report.error is None and not any(p.ran for p in report.probes if p.kind == "future" and p.compares_forwards):
        failures = [e for p in report.probes for e in p.errors]
        report.error = "no future-perturbation probe ran" + (f": {failures[0]}" if failures else "")
    report.seconds = time.perf_counter() - start
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
        raise AuditUsageError(
            f"probes must be moe.audit.registry.Probe objects, got {[type(p).__name__ for p in suite]}"
        )
    names = [p.name for p in suite]
    if len(set(names)) != len(names):
        raise AuditUsageError(f"probe names must be unique, got {names}")
    if not any(p.kind == "future" and p.compares_forwards for p in suite):
        raise AuditUsageError(f"at least one probe of kind 'future' with variants is needed, got {names}")
    return suite


def _audit_mode(
    runner: Runner, ctx: ProbeContext, cal: Calibration, suite: tuple[Probe, ...], alpha: float
) -> tuple[list[ProbeResult], Calibration]:
    try:
        return _run_probes(Comparator(runner, ctx.x, ctx.mode, cal, alpha), ctx, suite), cal
    except Misaligned:
        cal = cal.by_distribution()
        return _run_probes(Comparator(runner, ctx.x, ctx.mode, cal, alpha), ctx, suite), cal


def _run_probes(comparator: Comparator, ctx: ProbeContext, suite: tuple[Probe, ...]) -> list[ProbeResult]:
    results: dict[str, ProbeResult | None] = {p.name: _run(p, comparator, ctx) for p in suite if p.kind == "batch"}
    batch = [r for r in results.values() if r is not None and r.ran]
    claims = ctx.at.claims
    if batch and not any(r.leaks for r in batch) and (claims is None or claims.batch_invariant):
        comparator.allow_batching()
    for p in suite:
        if p.name not in results:
            results[p.name] = _run(p, comparator, ctx)
    return [r for r in (results[p.name] for p in suite) if r is not None]


def _run(probe: Probe, comparator: Comparator, ctx: ProbeContext) -> ProbeResult | None:
    if probe.measure is not None:
        return probe.measure(ctx)
    return comparator.judge(probe.variants(ctx), comparator.tally(probe.name, probe.kind))


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """The CPU generator, and every CUDA generator when CUDA is in use, as they were."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


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
