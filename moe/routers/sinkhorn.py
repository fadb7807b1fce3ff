"""Sinkhorn routing (S-BASE: Clark et al., "Unified Scaling Laws for Routed Language Models",
ICML 2022, arXiv 2202.01169; Megatron-Core's ``moe_router_load_balancing_type="sinkhorn"``,
``TopKRouter.sinkhorn_load_balancing`` and ``moe_utils.sinkhorn``): in training, each token's
top-k of a Sinkhorn-balanced assignment matrix; at inference, plain top-k.

Shape legend: N tokens (the whole forward: every sequence of the batch), E experts, K top-k,
A = N*K assignments.

Training balances the loads without an auxiliary loss. The N x E matrix ``exp(logits)`` is
scaled by a row factor d0 [N] and a column factor d1 [E], alternately, ``iterations`` times::

    d0 = (1 / N) / ((cost * d1).sum(1) + eps)      d1 = (1 / E) / ((cost * d0).sum(0) + eps)

so that its rows and columns approach equal sums (a doubly stochastic assignment up to scale),
and each token takes its top-k of ``d1 * cost * d0``. The combine weights are the router's
unbalanced scores at the chosen experts (the softmax over the E experts, or the sigmoid;
``normalize`` renormalises them over the k). Megatron-Core's ``sinkhorn`` iterates until the
mean change of d1 is below 1e-4, reading it on the host each time; here the count is fixed
(``iterations``), so the forward reads nothing on the host.

The column sums run over every token of the forward: whether token t gets an expert depends on
the later tokens of its sequence and on the other sequences of the batch. In training the router
claims neither causality nor batch invariance; in eval mode it is top-k of the scores (as
Megatron-Core's eval path), so causal, batch-invariant and decoded from no state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.checks import positive_int
from moe.routers.token_choice import TokenChoiceBase
from moe.routing import Claims, Routing, register_router, router_scores

EPS = 1e-8
"""Added to the row and column sums before dividing (Megatron-Core's ``sinkhorn``)."""


def sinkhorn(logits_NE: Tensor, iterations: int) -> Tensor:
    """float [N, E]: ``exp(logits)`` scaled by a row and a column factor, ``iterations`` rounds of
    Sinkhorn's alternating normalisation (rows to 1/N, columns to 1/E; see the module docstring)."""
    cost_NE = torch.exp(logits_NE)
    n, e = cost_NE.shape
    d0_N = cost_NE.new_ones(n)
    d1_E = cost_NE.new_ones(e)
    for _ in range(iterations):
        d0_N = (1.0 / n) / ((cost_NE * d1_E).sum(1) + EPS)
        d1_E = (1.0 / e) / ((cost_NE * d0_N.unsqueeze(1)).sum(0) + EPS)
    return d1_E * cost_NE * d0_N.unsqueeze(1)


@register_router("sinkhorn")
class SinkhornRouter(TokenChoiceBase):
    """Top-k of a Sinkhorn-balanced assignment in training, top-k of the scores in eval.

    Options: ``top_k`` (2), ``iterations`` (Sinkhorn rounds per training forward, default 10),
    ``gate`` ("softmax" | "sigmoid": the combine weights' scores; Megatron-Core takes the sigmoid
    for k = 1 and the softmax otherwise), ``normalize`` (default False: the scores themselves, as
    Megatron-Core weighs), ``route_scale``, ``z_loss_coef``. Refused, as Megatron-Core refuses them:
    balance losses (``aux_loss_coef`` defaults to 0 here), ``balance_rate`` and expert groups, and
    ``pre_softmax=False``.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        iterations: int = 10,
        normalize: bool = False,
        aux_loss_coef: float = 0.0,
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, normalize=normalize, aux_loss_coef=aux_loss_coef, **options)
        positive_int("iterations", iterations)
        self.refuse_balancing(
            "sinkhorn routing balances the loads itself (Megatron-Core requires --moe-aux-loss-coeff 0)"
        )
        if not self.pre_softmax or self.gate_fn == "sqrtsoftplus":
            raise ValueError(
                "sinkhorn weighs by the softmax or sigmoid scores: gate 'softmax' or 'sigmoid', pre_softmax"
            )
        self.iterations = iterations

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=False, causal_eval=True, batch_invariant=False, decode_consistent=True)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        if self.training:
            choice_NE = sinkhorn(logits_NE.detach(), self.iterations)
        else:
            choice_NE = router_scores(logits_NE.detach(), self.gate_fn)
        expert_NK = torch.topk(choice_NE, self.top_k, dim=-1).indices
        return self.replay(logits_NE, x_BTD, batch_shape, expert_NK, decoding=False)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given experts weighted as :meth:`route` weighs its own choices: the scores at them
        (:meth:`TokenChoiceBase.combine_weights`), so a replay of a recorded forward with unchanged
        weights is that forward bit for bit."""
        scores_NE = router_scores(logits_NE, self.gate_fn)
        weight_NK = self.combine_weights(logits_NE, scores_NE, expert_NK)
        return self.replayed_routing(logits_NE, scores_NE, expert_NK, weight_NK, batch_shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, iterations={self.iterations}"
