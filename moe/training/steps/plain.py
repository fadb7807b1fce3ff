"""The default step: the whole (possibly FSDP2-sharded) model's forward and backward on this
rank's batch, in M microbatches whose gradients accumulate (M = 1: one forward)."""

from __future__ import annotations

from functools import partial

from torch import Tensor

from moe.eval import autocast
from moe.global_balance import global_batch_loads
from moe.training.metrics import StepTally
from moe.training.steps.base import StepStrategy, register_strategy


@register_strategy
class Plain(StepStrategy):
    """Forward and backward of M = ``parallel.microbatches`` equal microbatches; the loss of
    each is divided by M, so the gradient is that of the batch mean. Sharded, FSDP2
    reduce-scatters once, after the last microbatch. Routers with a global balance loss read
    the counts of the whole batch, counted first (``moe.global_balance``) when M > 1."""

    name = "plain"
    default = True

    def gradients(self, idx_BT: Tensor, targets_BT: Tensor, tally: StepTally) -> None:
        model, m_total = self.place.model, self.cfg.parallel.microbatches
        chunks = list(zip(idx_BT.chunk(m_total), targets_BT.chunk(m_total)))
        with global_batch_loads(model, [partial(self._forward, idx_bT) for idx_bT, _ in chunks]):
            for m, (idx_bT, targets_bT) in enumerate(chunks):
                if self.place.sharded and m_total > 1:
                    model.set_requires_gradient_sync(m == m_total - 1)
                out = self._forward(idx_bT, targets_bT)
                loss = out.loss + out.aux_loss
                (loss / m_total if m_total > 1 else loss).backward()
                tally.add_output(out)

    def _forward(self, idx_bT: Tensor, targets_bT: Tensor | None = None):
        with autocast(self.place.device):
            return self.place.model(idx_bT, targets_bT)
