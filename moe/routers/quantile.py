"""Quantile balancing: top-k on router logits minus a per-expert bias set from the previous
global batch's quantiles (Megatron-Core, PR #5349, July 2026).

Shape legend: N tokens, E experts, K top-k, A = N*K assignments.

Each token takes its top-k experts by ``logits - beta``; ``beta`` (float32 [E]) holds still
within a step. In a training forward the router also computes, as Megatron-Core's
``qb_dual_update`` (megatron/core/transformer/moe/moe_utils.py) does, the bias that would
have balanced that forward: per token the (k+1)-th best adjusted logit alpha (the cut-off
its k-th choice had to beat), then per expert the (C+1)-th largest of ``logits - alpha``
over the N tokens, C = N*K // E, the target load. ``update_after_step`` averages those
per-forward biases over the step's training forwards (and, through the trainer's router
state averaging, over the data-parallel ranks: ``_update_router_qb_beta`` in
megatron/core/distributed/finalize_model_grads.py averages the ranks' local means),
blends them into ``beta`` with ``ema`` (Megatron's ``moe_router_quantile_balancing_ema``,
default 0: the latest estimate replaces the bias) and re-centres ``beta`` to mean 0.

Combine weights: the softmax over a token's k selected logits (Megatron's
``topk_routing_with_score_function`` with precomputed indices and ``use_pre_softmax`` off),
i.e. the softmax probabilities of the k experts renormalised to sum to 1.

Token n's experts read token n and ``beta``, which comes from past batches only: causal,
batch-invariant and decode-consistent in both modes, decoding with no state beyond the
position. It is the production peer of Expert Threshold routing (``ec_threshold`` with
``statistic="population"``): both route a token by comparing its scores with per-expert
cut-offs learned from earlier global batches.

Where ours differs: Megatron-Core asserts that N*K divides by E; here C = N*K // E whatever N
(a microbatch of any size trains). Megatron requires the auxiliary loss off; here
``aux_loss_coef`` defaults to 0 and may be set (the Switch loss on the selected experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routers.replayed import slot_softmax
from moe.routing import Router, Routing, register_router, slot_pairs


@register_router("quantile")
class QuantileBalancingRouter(Router):
    """Top-k on ``logits - beta``, ``beta`` the previous global batch's balancing quantiles.

    Options: ``top_k`` (in [1, E - 1]: the (k+1)-th choice sets the cut-off; default 2),
    ``ema`` (in [0, 1): weight of the old bias in each update; default 0), ``aux_loss_coef``
    (default 0), ``z_loss_coef``.
    """

    token_local = True

    def __init__(
        self, d_model: int, num_experts: int, *, top_k: int = 2, ema: float = 0.0, aux_loss_coef: float = 0.0, **base
    ) -> None:
        super().__init__(d_model, num_experts, aux_loss_coef=aux_loss_coef, **base)
        if not isinstance(top_k, int) or not 1 <= top_k < num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts - 1 = {num_experts - 1}], got {top_k!r}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema!r}")
        self.top_k = top_k
        self.ema = float(ema)
        self.register_buffer("beta", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("pending_beta", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.float32))

    def nominal_experts_per_token(self) -> float:
        return float(self.top_k)

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        """Replayed (``expert_NK``): the given experts (in their slots' order), weighted by the
        softmax over their current logits alone (``beta`` selects only). A replayed training
        forward records its balancing quantiles as a forward that chose would: from the current
        logits, whatever was routed (like ``ec_threshold``'s cut-offs: the bias is a statistic
        of the scores, not of the choices); a decoded chunk records nothing."""
        n, e = logits_NE.shape
        k = self.top_k
        scores_NE = logits_NE.detach().float()
        best = torch.topk(scores_NE - self.beta, k + 1, dim=-1)
        if record and n > 0:
            self._record_quantiles(scores_NE, best.values[:, k:])
        if expert_NK is None:  # every slot filled: the assignments without a host read
            expert_NK = best.indices[:, :k]
            token_A = torch.arange(n, device=logits_NE.device).repeat_interleave(k)
            slot_A = torch.arange(k, device=logits_NE.device).repeat(n)
        else:
            token_A, slot_A = slot_pairs(expert_NK)
        expert_A = expert_NK[token_A, slot_A]
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=slot_softmax(logits_NE, expert_NK)[token_A, slot_A],
            num_tokens=n,
            num_experts=e,
            aux_loss=self._aux_loss(logits_NE, F.softmax(logits_NE, dim=-1), expert_A),
            stats={**self._stats(expert_A, n * k), "quantile_bias": self.beta.clone()},
            batch_shape=batch_shape,
        )

    @torch.no_grad()
    def _record_quantiles(self, scores_NE: Tensor, alpha_N1: Tensor) -> None:
        """The bias that balances this forward: per expert, the (C+1)-th largest of
        ``scores - alpha`` over its N tokens (C = N*K // E, at most N - 1)."""
        n, e = scores_NE.shape
        c = min(n * self.top_k // e, n - 1)
        self.pending_beta += torch.topk(scores_NE - alpha_N1, c + 1, dim=0).values[-1]
        self.pending_count += 1

    @torch.no_grad()
    def update_after_step(self) -> None:
        # no recorded forward leaves beta as it is (chosen on the device: no host read)
        seen = self.pending_count > 0
        mean_E = self.pending_beta / self.pending_count.clamp_min(1.0)
        blended_E = self.ema * self.beta + (1.0 - self.ema) * mean_E
        self.beta.copy_(torch.where(seen, blended_E - blended_E.mean(), self.beta))
        self.pending_beta.zero_()
        self.pending_count.zero_()
