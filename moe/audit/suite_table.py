"""The built-in suite's summary: one row per target, what it claims against what the audit found."""

from __future__ import annotations

from moe.audit.report import AuditReport
from moe.audit.text import format_table, yes_no

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
                f"{'?' if claims is None else yes_no(claims.batch_invariant)}/{yes_no(r.batch_invariant)}",
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
        return f"?/{'same' if r.decode_consistent else 'differs'}"
    covered = [m for m, c in claimed.items() if c] if r.claims.decode_consistent else list(r.modes)
    covered = covered or list(r.modes)
    found = "differs" if any(m in r.decode_differs_in for m in covered) else "same"
    only = f" ({','.join(covered)})" if len(covered) < len(r.modes) else ""
    return f"{yes_no(r.claims.decode_consistent)}/{found}{only}"


def _claimed(claimed: dict[str, bool] | None) -> str:
    if claimed is None:
        return "?"
    if all(claimed.values()):
        return "yes"
    if not any(claimed.values()):
        return "no"
    return " ".join(f"{m} only" for m, c in claimed.items() if c)
