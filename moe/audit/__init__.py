"""The causality audit: does a router, an MoE layer or a model let position t see positions > t?

    from moe.audit import audit, assert_causal
    report = audit(model, idx_BT)           # or a router / layer / any callable on x_BTD
    print(report.table()); report.leaks, report.leaks_in, report.batch_invariant, report.regime
    assert_causal(model, idx_BT)            # in a project's tests: raises CausalityError with the report

``moe-audit`` (or ``python -m moe.audit``) runs it over every built-in router, or over
``--target``; see :mod:`moe.audit.cli`. The probes are registered in :mod:`moe.audit.probes`
(``register_probe`` adds one); :mod:`moe.audit.comparator` decides how a mode is judged.
"""

from moe.audit.engine import CausalityError, assert_causal, audit
from moe.audit.report import AuditReport, ProbeResult, reports_to_json, summary_table
from moe.audit.suite import BuiltinTarget, builtin_targets
from moe.audit.target import AuditUsageError

__all__ = [
    "AuditReport",
    "AuditUsageError",
    "BuiltinTarget",
    "CausalityError",
    "ProbeResult",
    "assert_causal",
    "audit",
    "builtin_targets",
    "reports_to_json",
    "summary_table",
]
