"""The routing agreement figures of a model target (:mod:`moe.agreement`), as the report keeps them."""

from __future__ import annotations

from torch import Tensor, nn

from moe.agreement import agreement_figures
from moe.audit.target import AuditTarget


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
