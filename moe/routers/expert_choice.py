"""Expert-choice routing (Zhou et al., 2022): each expert takes its top-C tokens of a group.

Shape legend: G groups, S tokens per group, N = G*S, E experts, C capacity, A = G*E*C.

Perfect balance by construction, and a token may get zero or several experts. Not causal in
a decoder: whether token t is among an expert's top-C depends on the scores of later tokens
of the group. That leak is the reason this package exists; see ``ec_threshold`` and
``ec_predictor`` for causal variants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routing import (
    Claims,
    Router,
    Routing,
    capacity_per_group,
    register_router,
    served_stats,
    slots_mask,
    sort_into_segments,
)


class ExpertChoiceBase(Router):
    """The options of the expert-choice family: ``capacity_factor`` (> 0, default 1.0; each
    expert's capacity C = ceil(cf * S / E) of a group of S tokens) and ``group`` ("sequence":
    S = T; "batch": S = B*T), the experts per token they set, and the Routing of weighted pairs
    (:meth:`make_routing`). Subclassed by expert choice itself and by the routers that learn
    from its statistics (``ec_threshold``)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        capacity_factor: float = 1.0,
        group: str = "sequence",
        **base,
    ) -> None:
        super().__init__(d_model, num_experts, **base)
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if group not in ("sequence", "batch"):
            raise ValueError(f"group must be 'sequence' or 'batch', got {group!r}")
        self.capacity_factor = float(capacity_factor)
        self.group = group

    def decode_support(self) -> str | None:
        """Why this router cannot decode (None if it can), and what to do instead."""
        reason = super().decode_support()
        if reason is None:
            return None
        return (
            f"{reason}; to decode with a cache, train with ec_threshold (causal thresholds learned from expert "
            "choice) or ec_predictor; to generate from this model, reroute the whole sequence so far at every step, "
            "without the cache"
        )

    def nominal_experts_per_token(self) -> float:
        return min(self.capacity_factor, float(self.num_experts))  # E experts x C = cf * S / E tokens, over S

    def make_routing(
        self,
        logits_NE: Tensor,
        probs_NE: Tensor,
        token_A: Tensor,
        expert_A: Tensor,
        batch_shape: tuple[int, int],
        aux: Tensor,
    ) -> Routing:
        """The pairs (``token_A``, ``expert_A``), each weighted by its score in ``probs_NE``, with
        the aux loss ``aux`` and :func:`moe.routing.served_stats`."""
        n, e = probs_NE.shape
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=probs_NE[token_A, expert_A],
            num_tokens=n,
            num_experts=e,
            aux_loss=aux,
            stats=served_stats(token_A, expert_A, n, e),
            batch_shape=batch_shape,
        )


@register_router("expert_choice")
class ExpertChoiceRouter(ExpertChoiceBase):
    """Each expert picks its top-C tokens per group by softmax score; weight = that score.

    Options: ``capacity_factor`` (> 0, default 1.0; C = ceil(cf * S / E)), ``group``
    ("sequence": S = T; "batch": S = B*T), ``aux_loss_coef`` (unused: balanced by
    construction), ``z_loss_coef``.
    Claims: not causal in either mode; batch-invariant iff ``group="sequence"``.
    """

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=False, causal_eval=False, batch_invariant=self.group == "sequence")

    def expert_choice(self, probs_NE: Tensor, batch_shape: tuple[int, int]) -> tuple[Tensor, Tensor, int]:
        """(token_A, expert_A, C): each expert's top-C tokens per group, expert-major per group."""
        b, t = batch_shape
        n, e = probs_NE.shape
        g, s = (b, t) if self.group == "sequence" else (1, n)
        c = capacity_per_group(self.capacity_factor, s, 1, e)
        scores_GES = probs_NE.detach().view(g, s, e).transpose(1, 2)
        idx_GEC = torch.topk(scores_GES, c, dim=-1).indices
        offset_G = torch.arange(g, device=probs_NE.device).view(g, 1, 1) * s
        token_A = (idx_GEC + offset_G).reshape(-1)
        expert_A = torch.arange(e, device=probs_NE.device).view(1, e, 1).expand(g, e, c).reshape(-1)
        return token_A, expert_A, c

    def chosen_pairs(self, probs_NE: Tensor, chosen_NE: Tensor, batch_shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """(token_A, expert_A) of the pairs ``chosen_NE`` marks, in :meth:`expert_choice`'s order
        (group, expert, decreasing score), so that a replayed routing runs the experts' rows in
        the order of the routing it was recorded from."""
        b, t = batch_shape
        token_A, expert_A = chosen_NE.nonzero(as_tuple=True)
        group_A = token_A // t if self.group == "sequence" else torch.zeros_like(token_A)
        score_A = probs_NE.detach()[token_A, expert_A].double()
        order_A, _, _ = sort_into_segments(group_A * probs_NE.shape[1] + expert_A, -score_A)
        return token_A[order_A], expert_A[order_A]

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        n, e = logits_NE.shape
        probs_NE = F.softmax(logits_NE, dim=-1)
        token_A, expert_A, c = self.expert_choice(probs_NE, batch_shape)
        return self.make_routing(logits_NE, probs_NE, token_A, expert_A, batch_shape, aux=self._z_loss(logits_NE))

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given (token, expert) pairs, each weighted by its current softmax score."""
        probs_NE = F.softmax(logits_NE, dim=-1)
        token_A, expert_A = self.chosen_pairs(probs_NE, slots_mask(expert_NK, logits_NE.shape[1]), batch_shape)
        return self.make_routing(logits_NE, probs_NE, token_A, expert_A, batch_shape, aux=self._z_loss(logits_NE))
