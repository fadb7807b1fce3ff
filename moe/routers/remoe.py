"""ReLU routing with an adaptively weighted L1 penalty (ReMoE, arXiv 2412.14711).

Shape legend: N tokens, E experts, A kept assignments.

The gate is ``relu(logits)``: token n uses expert e iff its logit is positive, with the ReLU
output itself as the combine weight (no top-k, no renormalisation), so routing is fully
differentiable and a token uses a varying number of experts. Sparsity is held by an L1
penalty on the gate values, weighted per expert by its share of the active assignments
(the paper's load-balancing refinement)::

    aux = lambda * sum_e f_e * mean_n relu(logits)[n, e],   f_e = E * active_e / sum_e' active_e'

whose coefficient ``lambda`` is tuned by a controller: after each optimiser step
(:meth:`update_after_step`) it is multiplied by ``l1_rate`` if the training forwards of the
step used more than ``top_k`` experts per token on average, divided by it if fewer. It starts
at ``l1_init``, so early training is nearly dense (the paper's first stage) and the mean
number of active experts settles at ``top_k``.

Token n's experts depend on token n and on ``lambda`` (learned from past batches only):
causal and batch-invariant in both modes, and decoding needs no state beyond the position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routing import Router, Routing, register_router, served_stats, slots_mask


@register_router("remoe")
class ReLURouter(Router):
    """ReMoE: ``relu(logits)`` gates with an adaptive, load-balanced L1 penalty.

    Options: ``top_k`` (the mean number of active experts per token the controller holds,
    default 2), ``l1_init`` (initial penalty coefficient, default 1e-8), ``l1_rate`` (the
    controller's multiplicative step, > 1, default 1.2), ``balanced`` (weight the L1 penalty
    by each expert's share of the assignments, default True), ``z_loss_coef``. The Switch
    loss (``aux_loss_coef``) is not used: the L1 penalty balances.
    """

    token_local = True

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        top_k: float = 2.0,
        l1_init: float = 1e-8,
        l1_rate: float = 1.2,
        balanced: bool = True,
        **base,
    ) -> None:
        super().__init__(d_model, num_experts, **base)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in (0, num_experts={num_experts}], got {top_k!r}")
        if not l1_init > 0 or not l1_rate > 1:
            raise ValueError(f"l1_init must be > 0 and l1_rate > 1, got {l1_init}, {l1_rate}")
        self.top_k = float(top_k)
        self.l1_rate = float(l1_rate)
        self.balanced = bool(balanced)
        self.register_buffer("l1_coef", torch.full((), float(l1_init), dtype=torch.float64))
        self._track_active_experts()

    def nominal_experts_per_token(self) -> float:
        return self.top_k

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        n, e = logits_NE.shape
        gates_NE = F.relu(logits_NE)
        # a replayed expert may gate 0
        active_NE = gates_NE.detach() > 0 if expert_NK is None else slots_mask(expert_NK, e)
        token_A, expert_A = active_NE.nonzero(as_tuple=True)
        if record:
            self._record_active(active_NE)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=gates_NE[token_A, expert_A],
            num_tokens=n,
            num_experts=e,
            aux_loss=self._l1_penalty(gates_NE, expert_A) + self._z_loss(logits_NE),
            stats=served_stats(token_A, expert_A, n, e),
            batch_shape=batch_shape,
        )

    def _l1_penalty(self, gates_NE: Tensor, expert_A: Tensor) -> Tensor:
        mean_E = gates_NE.mean(0)
        if self.balanced:
            mean_E = mean_E * (self.num_experts * self._assignment_fractions(expert_A, self.num_experts, mean_E.dtype))
        return self.l1_coef.to(mean_E.dtype) * mean_E.sum()

    @torch.no_grad()
    def update_after_step(self) -> None:
        # more experts than the target raise the penalty, fewer lower it; no forward seen: unchanged
        step = self._pop_active_excess(self.top_k)
        self.l1_coef.mul_(torch.pow(torch.full_like(self.l1_coef, self.l1_rate), step))
