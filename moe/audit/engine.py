"""``audit()``: one target, each mode in turn, the probes' variants judged by one comparator.

Order within a mode: the comparator measures the example's noise and picks the regime; the
batch probe runs (separate forwards); then, if the target is batch-invariant and repeats
itself exactly in a doubled batch, perturbed copies share forwards; then the future probes and
the decode probe. A deterministic-regime target found to draw data-dependent noise midway is
audited again from the start of the mode by distribution.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from moe.audit.comparator import Comparator, Misaligned
from moe.audit.probes import Probes, Sampler
from moe.audit.report import BATCH_PROBE, DECODE_PROBE, FUTURE_PROBES, AuditReport, ProbeResult
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
    ``example.max() + 1``).

    Raises :class:`AuditUsageError` for bad arguments only; whatever the target does (raise,
    return something unreadable) ends up in the report (``error``, or a probe's ``errors``).
    Afterwards the target's parameters, buffers (persistent or not) and training flags are as
    before, and so are the CPU and CUDA random generators.
    """
    start = time.perf_counter()
    modes = tuple(modes)
    for m in modes:
        if m not in MODES:
            raise AuditUsageError(f"unknown mode {m!r}; modes are 'train' and 'eval'")
    if not modes:
        raise AuditUsageError("at least one mode is needed")
    if not isinstance(trials, int) or trials < 1:
        raise AuditUsageError(f"trials must be a positive integer, got {trials!r}")
    if not isinstance(example, Tensor):
        raise AuditUsageError(f"the example input must be a torch.Tensor, got {type(example).__name__}")
    at = AuditTarget(target, output=output)
    sampler = Sampler(example, vocab_size if vocab_size is not None else _vocab_size(at, example))
    report = AuditReport(name=name or _name_of(target), modes=modes, claims=at.claims)
    runner = Runner(at, seed)
    with _rng_preserved(), at.preserved():
        for mode in modes:
            at.set_mode(mode)
            probes = Probes(at, runner, example, sampler, trials, seed)
            try:
                results, comparator = _audit_mode(runner, probes, example, mode)
            except TargetFailure as e:
                report.error = f"the target failed on the example in {mode} mode ({e})"
                break
            report.probes += results
            report.regimes[mode] = comparator.regime
            report.nonfinite[mode] = comparator.nonfinite
    if report.error is None and not any(p.ran for p in report.probes if p.name in FUTURE_PROBES[:2]):
        failures = [e for p in report.probes for e in p.errors]
        report.error = "no future-perturbation probe ran" + (f": {failures[0]}" if failures else "")
    report.seconds = time.perf_counter() - start
    return report


def _audit_mode(runner: Runner, probes: Probes, x: Tensor, mode: str) -> tuple[list[ProbeResult], Comparator]:
    comparator = Comparator(runner, x, mode, probes.calibration_inputs())
    try:
        return _run_probes(comparator, probes, mode), comparator
    except Misaligned:
        comparator = Comparator(runner, x, mode, regime="distribution")
        return _run_probes(comparator, probes, mode), comparator


def _run_probes(comparator: Comparator, probes: Probes, mode: str) -> list[ProbeResult]:
    batch = comparator.judge(probes.batch_interference(), comparator.tally(BATCH_PROBE))
    claims = probes.at.claims
    if not batch.leaks and (claims is None or claims.batch_invariant):
        comparator.allow_batching()
    results = [
        comparator.judge(probes.random_future(), comparator.tally("random_future")),
        comparator.judge(probes.adversarial_future(comparator.base.out.value_BTF), comparator.tally("adversarial_future")),
    ]
    jac = probes.jacobian(mode)
    if jac is not None:
        results.append(jac)
    return results + [batch, comparator.judge(probes.decode_consistency(), comparator.tally(DECODE_PROBE))]


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
