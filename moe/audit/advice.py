"""What to do after an audit, by the mechanism its evidence shows (never one text for every leak).

* a nonzero Jacobian d output[t] / d input[> t]: the output reads later inputs through a
  differentiable path (a mean over the sequence, a roll or shift in time, unmasked attention): not
  a routing decision, so a causal router would not remove it;
* a router of the target that claims the leak says its own mechanism: expert choice over
  positions (each expert takes its top tokens of the sequence or batch) -> ``ec_threshold`` /
  ``ec_predictor``; capacity kept by score (or GShard's choice order) -> ``priority="position"``
  with ``capacity_scope="prefix"``;
* a discrete change with neither (an opaque target): which tokens are served depends on later
  tokens, and the audit cannot tell which of the two; both remedies, each with its condition;
* buffers the forward updates (state carried from one call to the next, e.g. loss-free balancing
  biases): the audit restores them before every forward, so they are no leak; nothing to change.
"""

from __future__ import annotations

from typing import Protocol


class Findings(Protocol):
    """What the advice reads of a report (``moe.audit.report.AuditReport``, which imports this
    module: named here by what it has, not imported back)."""

    leaks: bool
    probes: list
    mechanisms: list[str]
    updated_buffers: list[str]


EXPERT_CHOICE, CAPACITY_BY_SCORE = "expert choice", "capacity by score"
"""The routing mechanisms the audit can name (from a router's own declaration)."""
_FIX = {
    EXPERT_CHOICE: "expert choice over positions (each expert takes its top tokens of the group): use ec_threshold "
    "or ec_predictor (thresholds or a predictor learned from expert choice, causal at inference), or dropless topk",
    CAPACITY_BY_SCORE: "capacity kept by score (a later, higher-scoring token takes an earlier token's slot): use "
    'capacity with priority="position" and capacity_scope="prefix" (slots counted over the prefix), or dropless topk',
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
        if continuous:
            out.append(
                "mechanism: the output at t reads later inputs through a differentiable path (d output[t] / "
                "d input[> t] is nonzero: a mean over the sequence, a shift or roll in time, unmasked attention); "
                "not a routing decision: make that computation causal (a mask or a shift); a causal router would "
                "not remove it"
            )
        routed = bool(discrete and (report.mechanisms or not continuous))
        if discrete and report.mechanisms:
            out += [f"mechanism: {_FIX[m]}" for m in report.mechanisms]
        elif routed:
            out.append(
                "mechanism: which tokens are served depends on later tokens (a discrete change, no gradient path; "
                "the audit cannot tell how it is routed). If experts or a block pick their top positions: "
                f"{_FIX[EXPERT_CHOICE]}. If tokens pick experts under a capacity kept by score: {_FIX[CAPACITY_BY_SCORE]}"
            )
        if routed:
            layers = " or ".join(
                f"moe.MoELayer(d_model, d_ff, num_experts, {_LAYER[m]})" for m in report.mechanisms or _LAYER
            )
            out.append(f"in your own block: {layers} (docs/routers.md)")
    if report.updated_buffers:
        out.append(
            f"state: its forward updates {', '.join(report.updated_buffers)}; the audit restores every buffer "
            "before every forward, so what one call leaves for the next is not counted as a leak (nothing to change)"
        )
    return out
