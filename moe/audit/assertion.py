"""``assert_causal``: the audit as one assertion in a project's own tests.

    from moe.audit import assert_causal

    def test_my_block_is_causal():
        assert_causal(MyBlock(), torch.randn(4, 32, 64))   # raises CausalityError with the report

It raises :class:`CausalityError`, an ``AssertionError`` (pytest shows it as a failed assertion,
with the report's summary and per-probe table as the message), when the audit finds a leak, is
INCONCLUSIVE in a mode, cannot run the target, finds a claim of the target false, or (when asked)
finds batch interference or a prefix that decodes differently. Otherwise it returns the report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from moe.audit.engine import audit
from moe.audit.report import AuditReport


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
    INCONCLUSIVE mode, audited at all, and no false claim. ``batch_invariant`` /
    ``decode_consistent``: also require that no sample's output depends on the other samples /
    that prefix-only forwards reproduce the full-sequence outputs. Returns the report."""
    __tracebackhide__ = True  # pytest shows the report, not this frame
    report = audit(target, example, **audit_options)
    problems = []
    if report.error:
        problems.append(f"NOT AUDITED: {report.error}")
    else:
        if report.leaks:
            problems.append(f"leaks in {', '.join(report.leaks_in)} mode")
        if report.inconclusive_in:
            problems.append(f"INCONCLUSIVE in {', '.join(report.inconclusive_in)} mode")
        if batch_invariant and not report.batch_invariant:
            problems.append("not batch-invariant")
        if decode_consistent and not report.decode_consistent:
            problems.append(f"prefix-only forwards differ in {', '.join(report.decode_differs_in)} mode")
        problems += [f"false claim: {c}" for c in report.false_claims]
    if problems:
        body = report.summary() if report.error else f"{report.summary()}\n\n{report.table()}"
        raise CausalityError(f"{report.name}: {'; '.join(problems)}\n\n{body}", report)
    return report
