"""The default step: the whole (possibly FSDP2-sharded) model's forward and backward on this
rank's batch, in M microbatches whose gradients accumulate (M = 1: one forward)."""

from __future__ import annotations

from torch import Tensor

from moe.eval import autocast
from moe.parallel.steps.base import StepStrategy, register_strategy


@register_strategy
class Plain(StepStrategy):
    """Forward and backward of M = ``parallel.microbatches`` equal microbatches; the loss of
    each is divided by M, so the gradient is that of the batch mean. Sharded, FSDP2
    reduce-scatters once, after the last microbatch."""

    name = "plain"
    default = True

    def gradients(self, idx_BT: Tensor, targets_BT: Tensor, tally) -> None:
        model, m_total = self.place.model, self.cfg.parallel.microbatches
        for m, (idx_bT, targets_bT) in enumerate(zip(idx_BT.chunk(m_total), targets_BT.chunk(m_total))):
            if self.place.sharded and m_total > 1:
                model.set_requires_gradient_sync(m == m_total - 1)
            with autocast(self.place.device):
                out = model(idx_bT, targets_bT)
            loss = out.loss + out.aux_loss
            (loss / m_total if m_total > 1 else loss).backward()
            tally.add_output(out)
