"""Token-choice routing: each token picks its top-k experts.

Shape legend: N tokens, E experts, K top-k, A kept assignments, D model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.checks import nonnegative_int, positive_int
from moe.routers.replayed import slot_softmax, weights_given_choices
from moe.routing import (
    SCORE_FUNCTIONS,
    Claims,
    Router,
    Routing,
    count_indices,
    dropped_fraction,
    register_router,
    router_scores,
    served_stats,
    slot_pairs,
)


class TokenChoiceBase(Router):
    """Shared top-k selection for token-choice routers: score functions, group-limited
    routing, route normalisation and scaling, and aux-loss-free balancing.

    The selection follows Megatron-Core's ``topk_routing_with_score_function``
    (megatron/core/transformer/moe/moe_utils.py) and torchtitan's ``TokenChoiceTopKRouter``
    (torchtitan/models/common/moe.py):

    * ``gate`` is the score function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"``
      (``sqrt(softplus(logit))``, Megatron's third score function; see
      :func:`moe.routing.router_scores`).
    * ``pre_softmax`` (softmax only; Megatron's ``use_pre_softmax``): True (default) takes the
      top-k of the softmax over all E experts; False takes the top-k of the logits, then the
      softmax over those k alone (Megatron's default, GraniteMoE's and Mixtral's original form).
    * ``normalize`` (torchtitan ``route_norm``, DeepSeek ``norm_topk_prob``): divide the k
      weights by their sum (+1e-20, as both peers do); ``route_scale`` (torchtitan
      ``route_scale``, Megatron ``moe_router_topk_scaling_factor``, DeepSeek
      ``routed_scaling_factor``) then multiplies them.
    * Group-limited routing (DeepSeek-V3; torchtitan ``num_expert_groups`` /
      ``num_limited_groups``; Megatron ``num_groups`` / ``group_topk``): the E experts form
      G = ``num_expert_groups`` groups of consecutive experts; each token scores a group by the
      sum of its best two selection scores in it, keeps its M = ``num_limited_groups`` best
      groups, and takes its top-k among their experts (:func:`group_limited_topk`). With
      expert parallelism over P ranks and G a multiple of P, a token's experts then live on at
      most M ranks.

    Aux-loss-free balancing (``balance_rate > 0``, arXiv 2408.15664): a per-expert bias
    (``balance_bias``) is added to the scores for *selection only* (group scores included,
    as all three peers do); combine weights use the unbiased scores. Loads seen in training
    forwards are accumulated; :meth:`update_after_step` moves each bias by ``balance_rate``
    towards the mean load (``b_e += rate * sign(mean_load - load_e)``). The bias comes from
    past batches only, so it never makes routing depend on future tokens, and decoding needs
    no state for it: it does not change while decoding. The bias is added whatever the rate,
    so a bias loaded from elsewhere (a DeepSeek-V3 ``e_score_correction_bias``) routes with
    ``balance_rate=0`` as a frozen correction. With ``pre_softmax=False`` it is added to the
    logits the top-k reads (Megatron adds no bias to softmax scores; torchtitan adds it to the
    softmax probabilities).

    Load-balancing losses (:meth:`token_choice_aux_loss`) count each token's top-k of the
    *unbiased, ungrouped* scores and average the scores normalised over the E experts, as
    Megatron's ``compute_routing_scores_for_aux_loss`` does (DeepSeek-V3's sequence-wise loss,
    arXiv 2412.19437 eq. 17-20, is defined the same way).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        top_k: int = 2,
        gate: str = "softmax",
        pre_softmax: bool = True,
        normalize: bool = True,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        balance_rate: float = 0.0,
        **base,
    ) -> None:
        super().__init__(d_model, num_experts, **base)
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")
        if gate not in SCORE_FUNCTIONS:
            raise ValueError(f"gate must be one of {', '.join(map(repr, SCORE_FUNCTIONS))}, got {gate!r}")
        if not pre_softmax and gate != "softmax":
            raise ValueError(f"pre_softmax=False applies to gate='softmax' only, got gate={gate!r}")
        if balance_rate < 0:
            raise ValueError(f"balance_rate must be >= 0, got {balance_rate}")
        if not route_scale > 0:
            raise ValueError(f"route_scale must be > 0, got {route_scale!r}")
        check_groups(num_experts, top_k, num_expert_groups, num_limited_groups)
        self.top_k = top_k
        self.gate_fn = gate
        self.pre_softmax = bool(pre_softmax)
        self.normalize = normalize
        self.route_scale = float(route_scale)
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.balance_rate = balance_rate
        self.register_buffer("balance_bias", torch.zeros(num_experts))
        self.register_buffer("load_seen", torch.zeros(num_experts))

    def nominal_experts_per_token(self) -> float:
        return float(self.top_k)

    def refuse_balancing(self, reason: str) -> None:
        """ValueError, starting with ``reason``, if a balance loss, ``balance_rate`` or expert
        groups are set: for a subclass that selects (or balances) by other means."""
        if self.has_balance_loss():
            raise ValueError(f"{reason}: set aux_loss_coef, seq_aux_loss_coef and global_aux_loss_coef to 0")
        if self.balance_rate > 0 or self.num_expert_groups is not None:
            raise ValueError(f"{reason}: balance_rate and num_expert_groups do not apply")

    def select(self, logits_NE: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Top-k choice per token: (scores_NE, expert_NK, weight_NK). ``scores_NE`` are the
        score function's outputs (softmax over all experts, or per-expert sigmoid /
        sqrt-softplus); weights come from the unbiased scores (normalised and scaled)."""
        scores_NE = router_scores(logits_NE, self.gate_fn)
        choice_NE = scores_NE.detach() if self.pre_softmax else logits_NE.detach()
        bias_E = self.balance_bias.to(choice_NE.dtype)
        choice_NE = choice_NE + F.pad(bias_E, (0, choice_NE.shape[1] - bias_E.numel()))  # null experts: no bias
        if self.num_expert_groups is not None:
            expert_NK = group_limited_topk(choice_NE, self.top_k, self.num_expert_groups, self.num_limited_groups)
        else:
            expert_NK = torch.topk(choice_NE, self.top_k, dim=-1).indices
        return scores_NE, expert_NK, self.combine_weights(logits_NE, scores_NE, expert_NK)

    def combine_weights(
        self, logits_NX: Tensor, scores_NX: Tensor, expert_NK: Tensor, over_NJ: Tensor | None = None
    ) -> Tensor:
        """float [N, K]: the combine weights of the experts in ``expert_NK``'s slots (-1: an
        empty slot, weight 0), from the unbiased scores whatever the balance bias and the groups
        (they select only): the scores themselves (``pre_softmax``) or the softmax of their
        logits alone, divided by their sum (``normalize``, +1e-20 as the peers) and times
        ``route_scale``. The softmax and the sum run over the token's slots (its own top-k in
        :meth:`select`; given experts in ``replay``, R3's formula), or over the experts
        ``over_NJ`` when given: the weight that an expert gets beside the router's current
        choices, for a record that lacks some of them (capacity drops, null experts)."""
        filled_NK = expert_NK >= 0
        if self.pre_softmax:
            weight_NK = scores_NX.gather(1, expert_NK.clamp_min(0)).masked_fill(~filled_NK, 0.0)
            mass_NJ = weight_NK if over_NJ is None else scores_NX.gather(1, over_NJ)
        elif over_NJ is None:
            weight_NK = mass_NJ = slot_softmax(logits_NX, expert_NK)
        else:  # its logit's share of the current choices' softmax denominator
            lse_N1 = torch.logsumexp(logits_NX.gather(1, over_NJ), dim=-1, keepdim=True)
            weight_NK = (logits_NX.gather(1, expert_NK.clamp_min(0)) - lse_N1).exp().masked_fill(~filled_NK, 0.0)
            mass_NJ = slot_softmax(logits_NX, over_NJ)
        if self.normalize:
            weight_NK = weight_NK / (mass_NJ.sum(-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weight_NK = weight_NK * self.route_scale
        return weight_NK

    def weights_beside_choices(self, logits_NX: Tensor, expert_NK: Tensor) -> tuple[Tensor, Tensor]:
        """(scores_NX, weight_NK): the router's scores and the combine weights of the experts in
        ``expert_NK``'s slots, for a replayed record that lacks some of the router's choices
        (capacity drops, null experts), so that a given expert's weight is normalised over the
        token's current top-k as :meth:`select` normalises it (a choice missing from the record
        keeps its share): a given expert among the current choices keeps its weight, another
        gets :meth:`combine_weights` over them (``moe.routers.replayed.weights_given_choices``)."""
        scores_NX, choice_NJ, weight_NJ = self.select(logits_NX)
        other_NK = self.combine_weights(logits_NX, scores_NX, expert_NK, over_NJ=choice_NJ)
        return scores_NX, weights_given_choices(expert_NK, choice_NJ, weight_NJ, other_NK)

    def replayed_routing(
        self, logits_NX: Tensor, scores_NX: Tensor, expert_NK: Tensor, weight_NK: Tensor, batch_shape: tuple[int, int]
    ) -> Routing:
        """The Routing of ``expert_NK``'s filled slots weighted by ``weight_NK`` (float [N, K]),
        with a forward's aux losses (:meth:`token_choice_aux_loss` of ``logits_NX`` and
        ``scores_NX``) and top-k's stats of the given experts, which the balance load counts
        (``replay``)."""
        n = expert_NK.shape[0]
        token_A, slot_A = slot_pairs(expert_NK)
        expert_A = expert_NK[token_A, slot_A]
        self.record_load(expert_A)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_NK[token_A, slot_A],
            num_tokens=n,
            num_experts=self.num_experts,
            aux_loss=self.token_choice_aux_loss(logits_NX, scores_NX, batch_shape),
            stats=self._stats(expert_A, n * self.top_k),
            batch_shape=batch_shape,
        )

    def token_choice_aux_loss(self, logits_NX: Tensor, scores_NX: Tensor, batch_shape: tuple[int, int]) -> Tensor:
        """The router's aux losses (:meth:`Router._aux_loss`) over the X columns of ``scores_NX``
        as Megatron-Core's ``compute_routing_scores_for_aux_loss`` defines them: the scores
        normalised over the X experts (softmax already is; sigmoid and sqrt-softplus are
        divided by their sum, +1e-20), and each token's top-k of the unbiased, ungrouped scores
        as its assignments (the routed experts differ from those only through the bias, the
        groups or, with null experts, nowhere)."""
        n = scores_NX.shape[0]
        if not self.has_balance_loss():
            return self._z_loss(logits_NX)
        probs_NX = scores_NX if self.gate_fn == "softmax" else scores_NX / (scores_NX.sum(-1, keepdim=True) + 1e-20)
        counted_NK = torch.topk(scores_NX.detach(), self.top_k, dim=-1).indices
        token_A = torch.arange(n, device=scores_NX.device).repeat_interleave(self.top_k)
        return self._aux_loss(logits_NX, probs_NX, counted_NK.reshape(-1), token_A, batch_shape)

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
        if null_experts and self.num_expert_groups is not None:
            raise ValueError("null_experts and group-limited routing (num_expert_groups) do not combine")
        self.null_experts = null_experts
        if null_experts:
            self.null_gate = nn.Linear(d_model, null_experts, bias=False)
            nn.init.normal_(self.null_gate.weight, std=d_model**-0.5)

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)

    def nominal_experts_per_token(self) -> float:
        return self.top_k * self.num_experts / (self.num_experts + self.null_experts)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        n = logits_NE.shape[0]
        if self.null_experts:
            null_NM = self.null_gate(x_BTD.reshape(n, -1)).to(logits_NE.dtype)
            return self._route_with_null(torch.cat([logits_NE, null_NM], 1), batch_shape)
        scores_NE, expert_NK, weight_NK = self.select(logits_NE)
        expert_A = expert_NK.reshape(-1)
        token_A = torch.arange(n, device=logits_NE.device).repeat_interleave(self.top_k)
        self.record_load(expert_A)
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_NK.reshape(-1),
            num_tokens=n,
            num_experts=self.num_experts,
            aux_loss=self.token_choice_aux_loss(logits_NE, scores_NE, batch_shape),
            stats=self._stats(expert_A, n * self.top_k),
            batch_shape=batch_shape,
        )

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """R3's formula (arXiv 2510.11370; Megatron-Core ``RouterReplay.get_replay_topk``): the
        given experts weighted by :meth:`select`'s formula at them (:meth:`combine_weights`: their
        current unbiased scores, or the softmax of their logits, normalised over them and
        scaled; the balance bias and the groups play no part); the aux losses are a forward's
        (:meth:`TokenChoiceBase.token_choice_aux_loss` counts the top-k of the current scores
        whatever was routed), and the balance load counts the given experts. With null experts
        the record holds the real ones only, so their weights are taken beside the token's
        current k choices (its null choices keep their share, as in :meth:`route`; see
        :meth:`TokenChoiceBase.weights_beside_choices`)."""
        if not self.null_experts:
            scores_NE = router_scores(logits_NE, self.gate_fn)
            weight_NK = self.combine_weights(logits_NE, scores_NE, expert_NK)
            return self.replayed_routing(logits_NE, scores_NE, expert_NK, weight_NK, batch_shape)
        n = logits_NE.shape[0]
        null_NM = self.null_gate(x_BTD.reshape(n, -1)).to(logits_NE.dtype)
        logits_NX = torch.cat([logits_NE, null_NM], 1)
        scores_NX, weight_NK = self.weights_beside_choices(logits_NX, expert_NK)
        routing = self.replayed_routing(logits_NX, scores_NX, expert_NK, weight_NK, batch_shape)
        routing.stats = served_stats(routing.token, routing.expert, n, self.num_experts)
        routing.stats["null_fraction"] = dropped_fraction(routing.expert.numel(), n * self.top_k, logits_NE.device)
        return routing

    def _route_with_null(self, logits_NX: Tensor, batch_shape: tuple[int, int]) -> Routing:
        """X = E + M columns: top-k over all, then the null choices (index >= E) dropped."""
        n, e = logits_NX.shape[0], self.num_experts
        scores_NX, choice_NK, weight_NK = self.select(logits_NX)
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
            aux_loss=self.token_choice_aux_loss(logits_NX, scores_NX, batch_shape),
            stats=stats,
            batch_shape=batch_shape,
        )


def check_groups(num_experts: int, top_k: int, num_groups: int | None, num_limited: int | None) -> None:
    """ValueError unless the group-limited routing options are both None, or G divides E into
    groups of at least two experts (a group's score is its best two), 1 <= M <= G, and the M
    groups hold at least k experts."""
    if num_groups is None and num_limited is None:
        return
    if num_groups is None or num_limited is None:
        raise ValueError("num_expert_groups and num_limited_groups are set together (or neither)")
    positive_int("num_expert_groups", num_groups)
    positive_int("num_limited_groups", num_limited)
    if num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(
            f"num_expert_groups={num_groups} must divide num_experts={num_experts} into groups of at least 2 experts"
        )
    if num_limited > num_groups:
        raise ValueError(f"num_limited_groups={num_limited} exceeds num_expert_groups={num_groups}")
    if top_k > num_limited * (num_experts // num_groups):
        raise ValueError(
            f"top_k={top_k} exceeds the {num_limited * (num_experts // num_groups)} experts of "
            f"num_limited_groups={num_limited} groups"
        )


def group_limited_topk(choice_NE: Tensor, top_k: int, num_groups: int, num_limited: int) -> Tensor:
    """int64 [N, K]: each token's top-k experts among those of its ``num_limited`` best groups
    (G = ``num_groups`` groups of E/G consecutive experts), a group scored by the sum of the
    token's two best ``choice_NE`` in it. As DeepSeek-V3 defines it (transformers'
    ``DeepseekV3TopkRouter.forward``, torchtitan's
    ``TokenChoiceTopKRouter._get_node_limited_routing_scores``); Megatron-Core's
    ``group_limited_topk`` sums the best ``top_k // group_topk`` instead of two (the same for
    DeepSeek-V3's k = 8, M = 4). Experts outside the kept groups get -inf, so the top-k never
    picks them (:func:`check_groups` guarantees k of them are kept)."""
    n, e = choice_NE.shape
    grouped_NGS = choice_NE.view(n, num_groups, e // num_groups)
    group_score_NG = grouped_NGS.topk(2, dim=-1).values.sum(-1)
    kept_NM = torch.topk(group_score_NG, num_limited, dim=-1).indices
    dropped_NG = torch.ones_like(group_score_NG, dtype=torch.bool).scatter_(1, kept_NM, False)
    masked_NE = grouped_NGS.masked_fill(dropped_NG.unsqueeze(-1), float("-inf")).view(n, e)
    return torch.topk(masked_NE, top_k, dim=-1).indices
