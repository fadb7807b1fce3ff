"""Top-p (dynamic) routing (Huang et al., "Harder Tasks Need More Experts", arXiv 2403.07652).

Shape legend: N tokens, E experts, A kept assignments.

Each token takes experts in order of decreasing router probability until their mass reaches
``p``: expert j (in that order) is kept iff the mass of the experts before it is below p, so
the first is always kept and a confident token uses fewer experts than an unsure one. The
paper's dynamic loss, the mean entropy of the router distribution, is added with weight
``entropy_loss_coef`` (it sharpens the distributions, so fewer experts reach p), beside the
Switch loss.

A fixed ``p`` leaves the mean number of experts per token to training. ``target_experts``
(designed here, so that a comparison at equal active compute needs no tuning of p) holds it
instead: after each optimiser step p moves by ``p_rate`` towards the target (down if the
step's training forwards used more experts per token than ``target_experts``, up if fewer),
learned from past batches only.

Token n's experts depend on token n (and on p, from past batches): causal and batch-invariant
in both modes; decoding needs no state beyond the position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routing import Router, Routing, register_router, served_stats, slots_mask


@register_router("top_p")
class TopPRouter(Router):
    """Top-p routing: the smallest set of most probable experts whose mass reaches p.

    Options: ``p`` (initial mass threshold in (0, 1], default 0.4), ``max_k`` (at most this
    many experts per token; default E), ``target_experts`` (None: p stays fixed; a number in
    [1, max_k]: p is adapted to hold the mean experts per token there), ``p_rate`` (p's step,
    default 0.002), ``entropy_loss_coef`` (default 1e-4), ``normalize`` (renormalise the kept
    weights to sum to 1, default True), ``route_scale`` (a constant factor on the combine
    weights, torchtitan's ``route_scale``; default 1), ``aux_loss_coef``,
    ``seq_aux_loss_coef``, ``global_aux_loss_coef``, ``z_loss_coef``. The score is the
    softmax only: a mass threshold needs scores that form a distribution.
    """

    token_local = True

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        p: float = 0.4,
        max_k: int | None = None,
        target_experts: float | None = None,
        p_rate: float = 0.002,
        entropy_loss_coef: float = 1e-4,
        normalize: bool = True,
        route_scale: float = 1.0,
        **base,
    ) -> None:
        super().__init__(d_model, num_experts, **base)
        max_k = num_experts if max_k is None else max_k
        if not 0 < p <= 1:
            raise ValueError(f"p must be in (0, 1], got {p!r}")
        if not isinstance(max_k, int) or not 1 <= max_k <= num_experts:
            raise ValueError(f"max_k must be an integer in [1, num_experts={num_experts}], got {max_k!r}")
        if target_experts is not None and not 1 <= target_experts <= max_k:
            raise ValueError(f"target_experts must be in [1, max_k={max_k}], got {target_experts!r}")
        if not p_rate > 0 or entropy_loss_coef < 0:
            raise ValueError(f"p_rate must be > 0 and entropy_loss_coef >= 0, got {p_rate}, {entropy_loss_coef}")
        self.max_k = max_k
        self.target_experts = None if target_experts is None else float(target_experts)
        self.p_rate = float(p_rate)
        self.entropy_loss_coef = float(entropy_loss_coef)
        self.normalize = bool(normalize)
        if not route_scale > 0:
            raise ValueError(f"route_scale must be > 0, got {route_scale!r}")
        self.route_scale = float(route_scale)
        self.register_buffer("p", torch.full((), float(p), dtype=torch.float64))
        self._track_active_experts()

    def nominal_experts_per_token(self) -> float | None:
        return self.target_experts

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        n, e = logits_NE.shape
        probs_NE = F.softmax(logits_NE, dim=-1)
        keep_NE = self._top_p(probs_NE.detach()) if expert_NK is None else slots_mask(expert_NK, e)
        token_A, expert_A = keep_NE.nonzero(as_tuple=True)
        weight_NE = probs_NE
        if self.normalize:  # dense, then gathered: (token, expert) pairs are distinct, so no backward sums into one row
            weight_NE = probs_NE / (probs_NE * keep_NE).sum(-1, keepdim=True).clamp_min(1e-20)
        weight_A = weight_NE[token_A, expert_A] * self.route_scale
        if record:
            self._record_active(keep_NE)
        entropy = -(probs_NE * torch.log(probs_NE.clamp_min(1e-20))).sum(-1).mean()
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_A,
            num_tokens=n,
            num_experts=e,
            aux_loss=self._aux_loss(logits_NE, probs_NE, expert_A, token_A, batch_shape)
            + self.entropy_loss_coef * entropy,
            stats={**served_stats(token_A, expert_A, n, e), "p": self.p.clone()},
            batch_shape=batch_shape,
        )

    def _top_p(self, probs_NE: Tensor) -> Tensor:
        """bool [N, E]: each token's most probable experts until their mass reaches p (at most max_k)."""
        sorted_NE, order_NE = torch.sort(probs_NE, dim=-1, descending=True, stable=True)
        before_NE = sorted_NE.cumsum(-1) - sorted_NE  # mass of the experts ranked above
        keep_sorted_NE = before_NE < self.p.to(sorted_NE.dtype)
        keep_sorted_NE[:, self.max_k :] = False
        return torch.zeros_like(keep_sorted_NE).scatter_(1, order_NE, keep_sorted_NE)

    @torch.no_grad()
    def update_after_step(self) -> None:
        excess = self._pop_active_excess(self.target_experts or 0.0)
        if self.target_experts is not None:  # more experts than the target lower p, fewer raise it
            self.p.copy_((self.p - self.p_rate * excess).clamp(self.p_rate, 1.0))
