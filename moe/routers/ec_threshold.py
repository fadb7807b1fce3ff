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

``statistic`` says which cut-off is averaged. ``"group"`` (default): the mean over the
step's groups (sequences, or the batch) of each group's C-th best score, C = ceil(cf * S / E).
``"population"`` (the protocol of Expert Threshold routing, arXiv 2603.11535): the score that
the best fraction cf / E of the step's *whole* token population reaches, read from a
per-expert histogram of the scores (``population_bins`` bins over [0, 1], linear within a
bin, so the cut-off is exact to well under one bin width, 1/4096 by default). The histogram
is summed over the microbatches of a step and, by the trainer's router-state averaging
(``moe.training.distributed.sync_router_state``), over the data-parallel ranks: the
threshold is that of the global batch, however the step is cut, and the forward needs no
collective. With ``aux_loss_coef=0`` (no auxiliary loss) and ``score`` "softmax" or
"sigmoid" this is Expert Threshold routing.

Decoding needs only the thresholds, which do not change while decoding (no state beyond the
position). A forward with a decode state routes like any other but records no statistics,
even in training mode: a chunk of new tokens is not an expert-choice group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.checks import positive_int
from moe.routers.expert_choice import ExpertChoiceBase
from moe.routing import (
    SCORE_FUNCTIONS,
    Routing,
    capacity_per_group,
    count_indices,
    register_router,
    router_scores,
    slots_mask,
)


@register_router("ec_threshold")
class ExpertChoiceThresholdRouter(ExpertChoiceBase):
    """Threshold routing learned from expert-choice statistics. Causal in train and eval.

    Options: ``capacity_factor`` and ``group`` (define the expert-choice statistic being
    tracked), ``statistic`` ("group" | "population", see the module docstring),
    ``population_bins`` (histogram resolution of "population", default 4096), ``score``
    ("softmax" | "sigmoid" | "sqrtsoftplus", :func:`moe.routing.router_scores`: the per-expert
    score compared with the threshold and used as the combine weight; "sqrtsoftplus" is
    unbounded, so only with ``statistic="group"``: the population's histogram covers [0, 1]),
    ``route_scale`` (a constant factor on the combine weights, torchtitan's ``route_scale``;
    default 1), ``normalize`` (divide each token's weights by their sum over the experts it
    takes, +1e-20 as top-k's ``normalize``, before ``route_scale``; default False: the score
    itself, as Expert Threshold routing weighs), ``momentum`` (EMA decay, default 0.99),
    ``aux_loss_coef`` (Switch loss on the thresholded assignments, default 0.01; 0 for Expert Threshold routing),
    ``seq_aux_loss_coef``, ``global_aux_loss_coef``, ``z_loss_coef``.
    """

    token_local = True

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        momentum: float = 0.99,
        statistic: str = "group",
        population_bins: int = 4096,
        score: str = "softmax",
        route_scale: float = 1.0,
        normalize: bool = False,
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, **options)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if statistic not in ("group", "population"):
            raise ValueError(f"statistic must be 'group' or 'population', got {statistic!r}")
        if score not in SCORE_FUNCTIONS:
            raise ValueError(f"score must be one of {', '.join(map(repr, SCORE_FUNCTIONS))}, got {score!r}")
        if score == "sqrtsoftplus" and statistic == "population":
            raise ValueError("score='sqrtsoftplus' is unbounded: the population histogram covers [0, 1] (use 'group')")
        if not route_scale > 0:
            raise ValueError(f"route_scale must be > 0, got {route_scale!r}")
        self.route_scale = float(route_scale)
        self.normalize = bool(normalize)
        positive_int("population_bins", population_bins)
        self.momentum = momentum
        self.statistic = statistic
        self.score = score
        self.register_buffer("ema_sum", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("ema_weight", torch.zeros((), dtype=torch.float64))
        self.register_buffer("pending_sum", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.float64))
        if statistic == "population":
            self.register_buffer("pending_hist", torch.zeros(num_experts, population_bins, dtype=torch.float64))

    @property
    def threshold(self) -> Tensor:
        """float64 [E]: the current per-expert score cut-off (chosen on the device: no sync)."""
        average_E = self.ema_sum / self.ema_weight.clamp_min(torch.finfo(torch.float64).tiny)
        return torch.where(self.ema_weight > 0, average_E, 1.0 / self.num_experts)

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        probs_NE = router_scores(logits_NE, self.score)
        scores_NE = probs_NE.detach()
        # a NaN score is below every threshold: routed to every expert instead, so the output is NaN
        # as other routers' is (not a clean zero); check_finite makes it an error, as for them
        mask_NE = (
            (scores_NE >= self.threshold.to(scores_NE.dtype)) | scores_NE.isnan()
            if expert_NK is None
            else slots_mask(expert_NK, logits_NE.shape[1])
        )
        token_A, expert_A = mask_NE.nonzero(as_tuple=True)
        if record:
            self._record_cutoffs(probs_NE.detach(), batch_shape)
        aux = self._aux_loss(logits_NE, probs_NE, expert_A, token_A, batch_shape)
        weights_NE = probs_NE
        if self.normalize:  # top-k's weight form: over the token's own experts
            weights_NE = probs_NE / (probs_NE.masked_fill(~mask_NE, 0.0).sum(-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights_NE = weights_NE * self.route_scale
        routing = self.make_routing(logits_NE, weights_NE, token_A, expert_A, batch_shape, aux=aux)
        routing.stats["threshold"] = self.threshold
        return routing

    @torch.no_grad()
    def _record_cutoffs(self, probs_NE: Tensor, batch_shape: tuple[int, int]) -> None:
        b, t = batch_shape
        n, e = probs_NE.shape
        if self.statistic == "population":
            bins = self.pending_hist.shape[1]
            bin_NE = (probs_NE.double() * bins).long().clamp_(0, bins - 1)
            flat = (torch.arange(e, device=probs_NE.device) * bins + bin_NE).reshape(-1)
            self.pending_hist += count_indices(flat, e * bins).view(e, bins)  # integer counts: exact, any order
            self.pending_count += n
            return
        g, s = (b, t) if self.group == "sequence" else (1, n)
        c = capacity_per_group(self.capacity_factor, s, 1, e)
        cutoff_GE = torch.topk(probs_NE.view(g, s, e), c, dim=1).values[:, -1, :]
        self.pending_sum += cutoff_GE.double().sum(0)
        self.pending_count += g

    @torch.no_grad()
    def update_after_step(self) -> None:
        # without pending statistics the average stays as it is; chosen on the device (no sync)
        seen = self.pending_count > 0
        if self.statistic == "population":
            mean_E = population_cutoff(self.pending_hist, min(self.capacity_factor / self.num_experts, 1.0))
            self.pending_hist.zero_()
        else:
            mean_E = self.pending_sum / self.pending_count.clamp_min(1.0)
        seen = seen & torch.isfinite(mean_E).all()  # a step of NaN scores leaves the thresholds as they were
        self.ema_sum.copy_(torch.where(seen, self.momentum * self.ema_sum + (1 - self.momentum) * mean_E, self.ema_sum))
        self.ema_weight.copy_(torch.where(seen, self.momentum * self.ema_weight + (1 - self.momentum), self.ema_weight))
        self.pending_sum.zero_()
        self.pending_count.zero_()


def population_cutoff(hist_EB: Tensor, fraction: float) -> Tensor:
    """float64 [E]: per expert, the score reached by the best ``fraction`` of the population
    whose scores in [0, 1] are counted in ``hist_EB`` (B equal bins; scores spread evenly within
    a bin). Computed on the device, no host read."""
    b = hist_EB.shape[1]
    above_EB = hist_EB.flip(1).cumsum(1).flip(1)  # tokens in bin j or higher
    want_E1 = fraction * above_EB[:, :1]
    top_E1 = ((above_EB >= want_E1).sum(1, keepdim=True) - 1).clamp_min(0)  # highest bin reaching the count
    higher_E1 = torch.cat([above_EB, above_EB.new_zeros(above_EB.shape[0], 1)], 1).gather(1, top_E1 + 1)
    in_bin_E1 = hist_EB.gather(1, top_E1).clamp_min(torch.finfo(torch.float64).tiny)
    inside_E1 = ((want_E1 - higher_E1) / in_bin_E1).clamp(0.0, 1.0)
    return ((top_E1 + 1 - inside_E1) / b).squeeze(1)
