"""Token-choice routing: each token picks its top-k experts.

Shape legend: N tokens, E experts, K top-k, A kept assignments, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.routing import Claims, DecodeState, Router, Routing, count_indices, register_router, softmax_or_sigmoid


class TokenChoiceBase(Router):
    """Shared top-k selection for token-choice routers, with aux-loss-free balancing.

    Aux-loss-free balancing (``balance_rate > 0``): a per-expert bias is added to the scores
    for *selection only* (combine weights use the unbiased scores). Loads seen in training
    forwards are accumulated; :meth:`update_after_step` moves each bias by ``balance_rate``
    towards the mean load (``b_e += rate * sign(mean_load - load_e)``). The bias comes from
    past batches only, so it never makes routing depend on future tokens, and decoding needs
    no state for it: it does not change while decoding.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        top_k: int = 2,
        gate: str = "softmax",
        normalize: bool = True,
        balance_rate: float = 0.0,
        **base,
    ) -> None:
        super().__init__(d_model, num_experts, **base)
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")
        if gate not in ("softmax", "sigmoid"):
            raise ValueError(f"gate must be 'softmax' or 'sigmoid', got {gate!r}")
        if balance_rate < 0:
            raise ValueError(f"balance_rate must be >= 0, got {balance_rate}")
        self.top_k = top_k
        self.gate_fn = gate
        self.normalize = normalize
        self.balance_rate = balance_rate
        self.register_buffer("balance_bias", torch.zeros(num_experts))
        self.register_buffer("load_seen", torch.zeros(num_experts))

    def select(self, logits_NE: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Top-k choice per token: (probs_NE, expert_NK, weight_NK), weights from unbiased probs."""
        probs_NE = softmax_or_sigmoid(logits_NE, self.gate_fn)
        scores_NE = probs_NE.detach() + self.balance_bias if self.balance_rate > 0 else probs_NE.detach()
        expert_NK = torch.topk(scores_NE, self.top_k, dim=-1).indices
        weight_NK = probs_NE.gather(1, expert_NK)
        if self.normalize:
            weight_NK = weight_NK / weight_NK.sum(-1, keepdim=True).clamp_min(1e-20)
        return probs_NE, expert_NK, weight_NK

    def record_load(self, expert_A: Tensor, kept_A: Tensor | None = None) -> None:
        """Count the assignments of ``expert_A`` (where the bool ``kept_A`` is True, if given)."""
        if self.training and self.balance_rate > 0:
            with torch.no_grad():
                self.load_seen += count_indices(expert_A, self.num_experts, kept_A).to(self.load_seen)

    @torch.no_grad()
    def update_after_step(self) -> None:
        # no load seen leaves the bias as it is (sign(0) = 0): no host-side test needed
        if self.balance_rate > 0:
            self.balance_bias += self.balance_rate * torch.sign(self.load_seen.mean() - self.load_seen)
            self.load_seen.zero_()


@register_router("topk")
class TopKRouter(TokenChoiceBase):
    """Dropless token-choice top-k (Mixtral / DeepSeek style). Causal and batch-invariant in
    both modes: a token's experts depend on that token alone.

    Options: ``top_k`` (default 2), ``gate`` ("softmax" | "sigmoid"), ``normalize`` (renormalise
    the k weights to sum to 1), ``balance_rate`` (aux-loss-free balancing), ``aux_loss_coef``,
    ``z_loss_coef``.
    """

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        return self.route(logits_NE, x_BTD, batch_shape)  # a token's experts depend on that token alone

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        n = logits_NE.shape[0]
        probs_NE, expert_NK, weight_NK = self.select(logits_NE)
        expert_A = expert_NK.reshape(-1)
        token_A = torch.arange(n, device=logits_NE.device).repeat_interleave(self.top_k)
        self.record_load(expert_A)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_NK.reshape(-1),
            num_tokens=n,
            num_experts=self.num_experts,
            aux_loss=self._aux_loss(logits_NE, probs_NE, expert_A),
            stats=self._stats(expert_A, n * self.top_k),
            batch_shape=batch_shape,
        )
