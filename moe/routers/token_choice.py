"""Token-choice routing: each token picks its top-k experts.

Shape legend: N tokens, E experts, K top-k, A kept assignments, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.checks import nonnegative_int
from moe.routers.replayed import slot_weights, weights_given_choices
from moe.routing import (
    Claims,
    DecodeState,
    Router,
    Routing,
    count_indices,
    dropped_fraction,
    register_router,
    served_stats,
    slot_pairs,
    softmax_or_sigmoid,
)


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

    def nominal_experts_per_token(self) -> float:
        return float(self.top_k)

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
    the k weights to sum to 1), ``balance_rate`` (aux-loss-free balancing), ``null_experts``,
    ``aux_loss_coef``, ``z_loss_coef``.

    Null experts (AdaMoE, arXiv 2406.13233): ``null_experts=M`` adds M experts that compute
    nothing (their output is zero), with gate rows of their own (``null_gate``). Each token
    takes its top-k of the E + M; the assignments to null experts are dropped, so a token uses
    between 0 and k real experts, and the combine weights are normalised over all k choices
    (a null choice keeps its share: it adds zero). The Switch loss balances all E + M, so a
    balanced router gives each token k * E / (E + M) real experts on average
    (:meth:`nominal_experts_per_token`). ``dropped_fraction`` is then the fraction of tokens
    with no real expert; ``null_fraction`` the fraction of the N * k choices that were null.
    """

    def __init__(self, d_model: int, num_experts: int, *, null_experts: int = 0, **options) -> None:
        super().__init__(d_model, num_experts, **options)
        nonnegative_int("null_experts", null_experts)
        if null_experts and self.balance_rate > 0:
            raise ValueError("null_experts balance through the Switch loss over all experts: use balance_rate=0")
        if null_experts and self.top_k > num_experts + null_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts + null_experts")
        self.null_experts = null_experts
        if null_experts:
            self.null_gate = nn.Linear(d_model, null_experts, bias=False)
            nn.init.normal_(self.null_gate.weight, std=d_model**-0.5)

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)

    def nominal_experts_per_token(self) -> float:
        return self.top_k * self.num_experts / (self.num_experts + self.null_experts)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        return self.route(logits_NE, x_BTD, batch_shape)  # a token's experts depend on that token alone

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        n = logits_NE.shape[0]
        if self.null_experts:
            null_NM = self.null_gate(x_BTD.reshape(n, -1)).to(logits_NE.dtype)
            return self._route_with_null(torch.cat([logits_NE, null_NM], 1), batch_shape)
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

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """R3's formula (arXiv 2510.11370; Megatron-Core ``RouterReplay.get_replay_topk``): the
        given experts' current scores, renormalised over them (``normalize``); the Switch loss
        counts them. With null experts the record holds the real ones only, so their weights are
        normalised over the token's current k choices (its null choices keep their share, as in
        :meth:`route`; see ``moe.routers.replayed.weights_given_choices``) and the Switch loss counts the
        current null choices beside them."""
        n = logits_NE.shape[0]
        token_A, slot_A = slot_pairs(expert_NK)
        expert_A = expert_NK[token_A, slot_A]
        if self.null_experts:
            null_NM = self.null_gate(x_BTD.reshape(n, -1)).to(logits_NE.dtype)
            logits_NX = torch.cat([logits_NE, null_NM], 1)
            probs_NX, choice_NJ, weight_NJ = self.select(logits_NX)
            weight_NK = weights_given_choices(expert_NK, choice_NJ, weight_NJ, probs_NX, self.normalize)
            counted_A = torch.cat([expert_A, choice_NJ[choice_NJ >= self.num_experts]])
            stats = served_stats(token_A, expert_A, n, self.num_experts)
            stats["null_fraction"] = dropped_fraction(expert_A.numel(), n * self.top_k, logits_NE.device)
            logits_NE, probs_NE = logits_NX, probs_NX
        else:
            probs_NE = softmax_or_sigmoid(logits_NE, self.gate_fn)
            weight_NK = slot_weights(probs_NE, expert_NK, self.normalize)
            counted_A, stats = expert_A, self._stats(expert_A, n * self.top_k)
            self.record_load(expert_A)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_NK[token_A, slot_A],
            num_tokens=n,
            num_experts=self.num_experts,
            aux_loss=self._aux_loss(logits_NE, probs_NE, counted_A),
            stats=stats,
            batch_shape=batch_shape,
        )

    def _route_with_null(self, logits_NX: Tensor, batch_shape: tuple[int, int]) -> Routing:
        """X = E + M columns: top-k over all, then the null choices (index >= E) dropped."""
        n, e = logits_NX.shape[0], self.num_experts
        probs_NX, choice_NK, weight_NK = self.select(logits_NX)
        choice_A = choice_NK.reshape(-1)
        token_A = torch.arange(n, device=logits_NX.device).repeat_interleave(self.top_k)
        real_A = choice_A < e
        token_A, expert_A, weight_A = token_A[real_A], choice_A[real_A], weight_NK.reshape(-1)[real_A]
        stats = served_stats(token_A, expert_A, n, e)
        stats["null_fraction"] = dropped_fraction(expert_A.numel(), n * self.top_k, logits_NX.device)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_A,
            num_tokens=n,
            num_experts=e,
            aux_loss=self._aux_loss(logits_NX, probs_NX, choice_A),
            stats=stats,
            batch_shape=batch_shape,
        )
