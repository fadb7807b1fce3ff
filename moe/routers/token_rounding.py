"""Token rounding (SonicMoE, arXiv 2512.14080): in training, each expert's token count over the
whole forward is rounded to a multiple of the grouped GEMM's tile, so no tile is padded; at
inference, plain top-k.

Shape legend: N tokens (the whole forward: every sequence of the batch), E experts, K top-k,
A kept assignments, M tile size.

The rule, as sonic-moe's token-rounding example (``forward_token_choice_rounding``) computes it:

1. each token's top-k of the softmax scores, weights renormalised over the k (as ``topk``);
2. each expert's count f_e of those choices, rounded to a multiple of M: to the nearest
   (``rounding="nearest"``, the example's ``nr``; halves to even, as ``torch.round``), up
   (``"up"``) or down (``"down"``), at most N;
3. each expert ranks the N tokens: first the tokens that chose it, by their renormalised
   weight, then the others, by their softmax score (ties keep token order), and keeps its
   first ``round(f_e)``. Rounding down drops the choices of its lowest weights; rounding up
   adds the best-scored tokens that did not choose it, at their softmax score.

A token may so end up with 0 to E experts. In training the kept set depends on every token
of the forward (later positions and other sequences): the router claims neither causality nor
batch invariance there. In eval mode it is ``topk`` exactly (so causal, batch-invariant and
decoded from no state), which is what a server runs: the model trains on one routing and
serves another (``moe.agreement.train_serve_agreement`` measures how often they differ).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.checks import positive_int
from moe.routers.token_choice import TokenChoiceBase
from moe.routing import Claims, Routing, register_router, served_stats, slots_mask

ROUNDINGS = ("nearest", "up", "down")
"""``rounding``: how each expert's count is rounded to a tile multiple (sonic-moe's ``nr``, ``up``, ``down``)."""


@register_router("token_rounding")
class TokenRoundingRouter(TokenChoiceBase):
    """Top-k whose per-expert counts are rounded to tile multiples in training (see the module).

    Options: ``top_k`` (2), ``tile_size`` M (128, sonic-moe's ``Mtile``; keep it well below the
    forward's mean count N*k/E, or rounding to the nearest multiple empties experts),
    ``rounding`` ("nearest", "up", "down"), and the Switch and z losses of every router. The
    scores are SonicMoE's: the softmax, top-k before renormalising, no scale, no groups, no bias;
    other score options of ``topk`` are refused.

    Stats: ``dropped_fraction`` (tokens with no expert), ``rounded_out`` and ``rounded_in`` (top-k
    choices dropped by rounding down, and choices added by rounding up, per N*k slots).
    """

    def __init__(self, d_model: int, num_experts: int, *, tile_size: int = 128, rounding: str = "nearest", **options):
        super().__init__(d_model, num_experts, **options)
        positive_int("tile_size", tile_size)
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
        refused = {
            "gate": self.gate_fn != "softmax",
            "pre_softmax": not self.pre_softmax,
            "normalize": not self.normalize,
            "route_scale": self.route_scale != 1.0,
            "num_expert_groups": self.num_expert_groups is not None,
            "balance_rate": self.balance_rate > 0,
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(
                f"token_rounding routes as SonicMoE does (softmax scores, top-k renormalised, no scale, groups or "
                f"bias): remove {', '.join(bad)}"
            )
        self.tile_size, self.rounding = tile_size, rounding

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=False, causal_eval=True, batch_invariant=False, decode_consistent=True)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        scores_NE, expert_NK, weight_NK = self.select(logits_NE)
        chosen_NE = slots_mask(expert_NK, self.num_experts)
        if self.training:
            chosen_NE = self.rounded_choice(scores_NE.detach(), expert_NK, weight_NK.detach(), chosen_NE)
        return self._routing(logits_NE, scores_NE, expert_NK, weight_NK, chosen_NE, batch_shape)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The recorded pairs, each weighted as :meth:`route` weighs it from the current scores: its
        renormalised top-k weight where the expert is among the token's current top-k, else its
        softmax score (a pair that rounding up added)."""
        scores_NE, choice_NK, weight_NK = self.select(logits_NE)
        chosen_NE = slots_mask(expert_NK, self.num_experts)
        return self._routing(logits_NE, scores_NE, choice_NK, weight_NK, chosen_NE, batch_shape)

    @torch.no_grad()
    def rounded_choice(self, scores_NE: Tensor, expert_NK: Tensor, weight_NK: Tensor, topk_NE: Tensor) -> Tensor:
        """bool [N, E]: each expert's first ``round(f_e)`` tokens in its ranking (the module's step 3)."""
        n, m = scores_NE.shape[0], self.tile_size
        count_E = topk_NE.sum(0)
        if self.rounding == "nearest":
            rounded_E = torch.round(count_E.double() / m).long() * m
        elif self.rounding == "up":
            rounded_E = (count_E + m - 1) // m * m
        else:
            rounded_E = count_E // m * m
        # the top-k choices rank first (weights in (0, 1]), the rest after them (scores - 1 <= 0)
        value_NE = (scores_NE - 1.0).scatter(1, expert_NK, weight_NK)
        order_NE = torch.argsort(value_NE, dim=0, descending=True, stable=True)
        rank_NE = torch.empty_like(order_NE).scatter_(
            0, order_NE, torch.arange(n, device=order_NE.device).view(n, 1).expand_as(order_NE)
        )
        return rank_NE < rounded_E.clamp_max(n)

    def _routing(
        self,
        logits_NE: Tensor,
        scores_NE: Tensor,
        expert_NK: Tensor,
        weight_NK: Tensor,
        chosen_NE: Tensor,
        batch_shape: tuple[int, int],
    ) -> Routing:
        """The pairs of ``chosen_NE`` (token-major, experts in index order), a top-k choice at its
        renormalised weight and any other pair at its softmax score."""
        n, e = scores_NE.shape
        weight_NE = scores_NE.scatter(1, expert_NK, weight_NK)
        token_A, expert_A = chosen_NE.nonzero(as_tuple=True)
        topk_NE = slots_mask(expert_NK, e)
        stats = served_stats(token_A, expert_A, n, e)
        stats["rounded_out"] = (topk_NE & ~chosen_NE).sum() / float(n * self.top_k)
        stats["rounded_in"] = (chosen_NE & ~topk_NE).sum() / float(n * self.top_k)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_NE[token_A, expert_A],
            num_tokens=n,
            num_experts=e,
            aux_loss=self.token_choice_aux_loss(logits_NE, scores_NE, batch_shape),
            stats=stats,
            batch_shape=batch_shape,
        )
