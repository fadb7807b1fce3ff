"""Expert choice in training, a causal per-token predictor at inference (Mixture-of-Depths style).

Shape legend: N tokens, D model width, E experts, A assignments.

Training routes by expert choice (non-causal, like ``expert_choice``) and trains a small
predictor beside it, on stop-gradient inputs, to tell from token n alone whether each expert
would pick it (binary cross-entropy against expert choice's selections, added to
``aux_loss``). Eval mode routes token n to expert e iff the predictor says so, with the
router's softmax score as weight: causal and batch-invariant at inference only, where it
decodes with no state beyond the position.

The train/inference mismatch this creates is exactly what ``experiments/leakage_gap.py``
measures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.routers.expert_choice import ExpertChoiceRouter
from moe.routing import Claims, Routing, register_router, slots_mask


@register_router("ec_predictor")
class ExpertChoicePredictorRouter(ExpertChoiceRouter):
    """Expert choice in train mode (not causal); a learned causal predictor in eval mode.

    Options: ``capacity_factor``, ``group`` (as ``expert_choice``), ``predictor_hidden``
    (0: a linear predictor D -> E; else a bias-free SiLU MLP with this width),
    ``predictor_loss_coef`` (weight of the predictor's BCE loss, default 0.1), ``z_loss_coef``.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        predictor_hidden: int = 0,
        predictor_loss_coef: float = 0.1,
        **options,
    ) -> None:
        super().__init__(d_model, num_experts, **options)
        if predictor_hidden < 0 or predictor_loss_coef < 0:
            raise ValueError("predictor_hidden and predictor_loss_coef must be >= 0")
        if predictor_hidden == 0:
            self.predictor = nn.Linear(d_model, num_experts, bias=False)
        else:
            self.predictor = nn.Sequential(
                nn.Linear(d_model, predictor_hidden, bias=False),
                nn.SiLU(),
                nn.Linear(predictor_hidden, num_experts, bias=False),
            )
        self.predictor_loss_coef = predictor_loss_coef

    @property
    def claims(self) -> Claims:
        return Claims(
            causal_train=False, causal_eval=True, batch_invariant=self.group == "sequence", decode_consistent=True
        )

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        return self._route(logits_NE, x_BTD, batch_shape)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given pairs weighted by their current softmax scores; in training the predictor
        still learns what expert choice on the current scores would pick (its target is not a
        choice of the routing but a statistic of the scores)."""
        return self._route(logits_NE, x_BTD, batch_shape, slots_mask(expert_NK, logits_NE.shape[1]))

    def _route(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], chosen_NE: Tensor | None = None
    ) -> Routing:
        """``chosen_NE`` (bool [N, E]): route to the pairs it marks instead of choosing."""
        n, e = logits_NE.shape
        probs_NE = F.softmax(logits_NE, dim=-1)
        pred_logits_NE = self.predictor(x_BTD.reshape(n, -1).detach()).to(probs_NE.dtype)
        if self.training:
            token_A, expert_A, _ = self.expert_choice(probs_NE, batch_shape)
            target_NE = torch.zeros_like(probs_NE)
            target_NE[token_A, expert_A] = 1.0
            bce = F.binary_cross_entropy_with_logits(pred_logits_NE, target_NE)
            aux = self._z_loss(logits_NE) + self.predictor_loss_coef * bce
            if chosen_NE is not None:
                token_A, expert_A = self.chosen_pairs(probs_NE, chosen_NE, batch_shape)
            routing = self.make_routing(logits_NE, probs_NE, token_A, expert_A, batch_shape, aux=aux)
            agree = ((pred_logits_NE.detach() > 0) == (target_NE > 0)).float().mean()
            routing.stats["predictor_accuracy"] = agree
            return routing
        chosen_NE = pred_logits_NE > 0 if chosen_NE is None else chosen_NE
        token_A, expert_A = chosen_NE.nonzero(as_tuple=True)
        return self.make_routing(logits_NE, probs_NE, token_A, expert_A, batch_shape, aux=self._z_loss(logits_NE))
