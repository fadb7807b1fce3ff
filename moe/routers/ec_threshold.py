"""Causal expert choice by learned thresholds.

Shape legend: N tokens, E experts, C capacity, A assignments.

Expert choice keeps, per expert, the tokens whose score is at least that expert's C-th best
score of the group. This router estimates that cut-off from past batches instead of reading
it off the current one: an exponential moving average (bias-corrected, as in Adam) of each
expert's C-th best score. Token n goes to expert e iff ``probs[n, e] >= threshold[e]``, which
needs nothing but token n: causal and batch-invariant in *both* modes.

The statistics of each training forward are accumulated and folded into the average by
:meth:`update_after_step` (call it after the optimiser step, e.g. via
``moe.update_routers(model)``), so the thresholds used by a forward come from earlier
batches only. Before the first update the thresholds are 1/E.

Decoding needs only the thresholds, which do not change while decoding (no state beyond the
position). A forward with a decode state routes like any other but records no statistics,
even in training mode: a chunk of new tokens is not an expert-choice group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routers.expert_choice import ExpertChoiceRouter
from moe.routing import Claims, DecodeState, Routing, capacity_per_group, register_router


@register_router("ec_threshold")
class ExpertChoiceThresholdRouter(ExpertChoiceRouter):
    """Threshold routing learned from expert-choice statistics. Causal in train and eval.

    Options: ``capacity_factor`` and ``group`` (define the expert-choice statistic being
    tracked), ``momentum`` (EMA decay, default 0.99), ``aux_loss_coef`` (Switch loss on the
    thresholded assignments, default 0.01), ``z_loss_coef``.
    """

    def __init__(self, d_model: int, num_experts: int, *, momentum: float = 0.99, **options) -> None:
        super().__init__(d_model, num_experts, **options)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.register_buffer("ema_sum", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("ema_weight", torch.zeros((), dtype=torch.float64))
        self.register_buffer("pending_sum", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.float64))

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)

    @property
    def threshold(self) -> Tensor:
        """float64 [E]: the current per-expert score cut-off (chosen on the device: no sync)."""
        average_E = self.ema_sum / self.ema_weight.clamp_min(torch.finfo(torch.float64).tiny)
        return torch.where(self.ema_weight > 0, average_E, 1.0 / self.num_experts)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        return self._route(logits_NE, batch_shape, record=self.training)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        return self._route(logits_NE, batch_shape, record=False)

    def _route(self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool) -> Routing:
        probs_NE = F.softmax(logits_NE, dim=-1)
        mask_NE = probs_NE.detach() >= self.threshold.to(probs_NE.dtype)
        token_A, expert_A = mask_NE.nonzero(as_tuple=True)
        if record:
            self._record_cutoffs(probs_NE.detach(), batch_shape)
        routing = self.make_routing(
            logits_NE, probs_NE, token_A, expert_A, batch_shape, aux=self._aux_loss(logits_NE, probs_NE, expert_A)
        )
        routing.stats["threshold"] = self.threshold
        return routing

    @torch.no_grad()
    def _record_cutoffs(self, probs_NE: Tensor, batch_shape: tuple[int, int]) -> None:
        b, t = batch_shape
        n, e = probs_NE.shape
        g, s = (b, t) if self.group == "sequence" else (1, n)
        c = capacity_per_group(self.capacity_factor, s, 1, e)
        cutoff_GE = torch.topk(probs_NE.view(g, s, e), c, dim=1).values[:, -1, :]
        self.pending_sum += cutoff_GE.double().sum(0)
        self.pending_count += g

    @torch.no_grad()
    def update_after_step(self) -> None:
        # without pending statistics the average stays as it is; chosen on the device (no sync)
        seen = self.pending_count > 0
        mean_E = self.pending_sum / self.pending_count.clamp_min(1.0)
        self.ema_sum.copy_(torch.where(seen, self.momentum * self.ema_sum + (1 - self.momentum) * mean_E, self.ema_sum))
        self.ema_weight.copy_(torch.where(seen, self.momentum * self.ema_weight + (1 - self.momentum), self.ema_weight))
        self.pending_sum.zero_()
        self.pending_count.zero_()
