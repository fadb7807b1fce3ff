"""Global-step quantile balancing (Kimi K3 technical report §2.3.3 and Appendix D): the expert
bias solved, before each optimiser step, from histograms of the whole step.

Shape legend: N tokens, E experts, K top-k, R histogram bins (``num_bins``), L routers of a model.

Sigmoid scores ``s = sigmoid(logits)``; each token takes the first K of its top-(K+1) of
``s + b`` (``b``: the expert bias, float32 [E], fixed within a step) and keeps the (K+1)-th
value ``alpha`` as its cut-off. Expert j would be chosen by token i under a bias ``b_j >=
r_ij = alpha_i - s_ij``, so the bias that gives expert j its share K/E of the step's m tokens
is the K/E quantile of ``r[:, j]``. Every training forward adds its ``r`` to per-expert
histograms of R uniform bins over ``[min(b) - 1, max(b) + 1]`` (where every ``r`` lies, the
scores being in (0, 1)); :func:`solve_quantile_biases` sums them over the step's microbatches
and the data-parallel ranks (``Router.context.stats_group``), one all-reduce for all L routers, reads
the K/E quantile of each expert's histogram (linear inside the bin that holds it), centres the
biases to mean 0 and empties the histograms. :func:`register_quantile_balancing_hook` runs it
as an optimiser pre-step hook (the trainer registers it); without one, ``update_after_step``
(``moe.update_routers``) solves each router alone. The counts are integers, so the bias is the
same however the step's tokens are cut into microbatches and ranks.

Combine weights come from the unbiased scores (``TokenChoiceBase.combine_weights``: the scores
at the chosen experts, divided by their sum with ``normalize``, times ``route_scale``); no
balance loss. A token's experts read that token and a bias from past steps: causal,
batch-invariant and decode-consistent in both modes, decoding with no state.

Peers: torchtitan's ``QuantileBalancedTopKRouter`` (``num_bins=1000``,
``register_moe_quantile_balancing_hook``, an optimiser step pre-hook); Megatron-Core's
``--moe-router-load-balancing-type quantile_balancing`` with
``--moe-router-quantile-balancing-estimation-scope global_batch`` and
``--moe-router-qb-num-bins`` (default 1000). Both require sigmoid scores and no auxiliary
loss (``--moe-aux-loss-coeff 0``), and torchtitan refuses group-limited routing: refused here
too. Megatron's ``micro_batch`` scope (its default, PR #5349) is router ``quantile``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.checks import positive_int
from moe.routers.token_choice import TokenChoiceBase
from moe.routing import Routing, register_router, router_scores


@register_router("quantile_global")
class GlobalQuantileBalancingRouter(TokenChoiceBase):
    """Top-k of sigmoid scores plus a bias solved from the whole step's quantiles.

    Options: ``top_k`` (in [1, E - 1]; default 2), ``num_bins`` (R, default 1000, the report's),
    ``normalize`` (default True), ``route_scale`` (default 1), ``z_loss_coef``. Refused:
    ``gate`` other than "sigmoid", any balance loss (``aux_loss_coef`` defaults to 0 here),
    ``balance_rate`` and expert groups.
    """

    token_local = True
    solved_by_hook = False
    """True once :func:`register_quantile_balancing_hook` solves this router's bias."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        num_bins: int = 1000,
        gate: str = "sigmoid",
        aux_loss_coef: float = 0.0,
        **options,
    ) -> None:
        if gate != "sigmoid":
            raise ValueError(f"quantile balancing needs sigmoid scores (gate='sigmoid'), got gate={gate!r}")
        super().__init__(d_model, num_experts, gate=gate, aux_loss_coef=aux_loss_coef, **options)
        positive_int("num_bins", num_bins)
        if not self.top_k < num_experts:
            raise ValueError(f"top_k must be below num_experts={num_experts}: the (k+1)-th choice is the cut-off")
        self.refuse_balancing(
            "quantile balancing sets the bias itself, with no auxiliary loss (Megatron-Core requires --moe-aux-loss-coeff 0)"
        )
        self.num_bins = num_bins
        self.register_buffer("histogram_ER", torch.zeros(num_experts, num_bins, dtype=torch.int64), persistent=False)

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        """Replayed (``expert_NK``): the given experts weighted by the current unbiased scores at
        them; a replayed training forward still adds its cut-offs to the histograms, from the
        current scores and bias (a statistic of the scores, as ``quantile``'s), a decoded chunk
        nothing."""
        scores_NE = router_scores(logits_NE, "sigmoid")
        best = torch.topk(scores_NE.detach() + self.balance_bias.to(scores_NE.dtype), self.top_k + 1, dim=-1)
        if record:
            self._observe(best.values[:, self.top_k :] - scores_NE.detach())
        if expert_NK is None:
            expert_NK = best.indices[:, : self.top_k]
        weight_NK = self.combine_weights(logits_NE, scores_NE, expert_NK)
        routing = self.replayed_routing(logits_NE, scores_NE, expert_NK, weight_NK, batch_shape)
        routing.stats["quantile_bias"] = self.balance_bias.clone()
        return routing

    def bin_range(self) -> tuple[Tensor, Tensor]:
        """(lower edge, bin width) of this step's histograms: ``[min(b) - 1, max(b) + 1]`` in R bins."""
        low, high = self.balance_bias.min() - 1.0, self.balance_bias.max() + 1.0
        return low, (high - low) / self.num_bins

    @torch.no_grad()
    def _observe(self, required_NE: Tensor) -> None:
        """Add the required biases ``r = alpha - s`` of one forward to the histograms."""
        low, width = self.bin_range()
        bin_NE = ((required_NE.float() - low) / width).floor().long().clamp_(0, self.num_bins - 1)
        flat_A = (torch.arange(self.num_experts, device=bin_NE.device) * self.num_bins + bin_NE).reshape(-1)
        self.histogram_ER.view(-1).index_add_(0, flat_A, torch.ones_like(flat_A))

    @torch.no_grad()
    def solve_bias(self, histogram_ER: Tensor) -> None:
        """Set the bias to the K/E quantile of each expert's histogram (``histogram_ER``: the
        step's counts, summed over microbatches and ranks), centred to mean 0; an empty
        histogram (no training forward) leaves it as it was. No host read."""
        low, width = self.bin_range()
        total_E = histogram_ER.sum(-1)
        target_E = total_E.double() * self.top_k / self.num_experts
        cum_ER = histogram_ER.cumsum(-1)
        bin_E = (cum_ER < target_E.ceil().unsqueeze(-1)).sum(-1).clamp_max(self.num_bins - 1)
        in_bin_E = histogram_ER.gather(-1, bin_E.unsqueeze(-1)).squeeze(-1)
        before_E = cum_ER.gather(-1, bin_E.unsqueeze(-1)).squeeze(-1) - in_bin_E
        inside_E = (target_E - before_E) / in_bin_E.clamp_min(1)
        bias_E = (low + width * (bin_E + inside_E)).float()
        self.balance_bias.copy_(torch.where(total_E.sum() > 0, bias_E - bias_E.mean(), self.balance_bias))

    def update_after_step(self) -> None:
        if not self.solved_by_hook:
            solve_quantile_biases([self])

    def nominal_experts_per_token(self) -> float:
        return float(self.top_k)


def quantile_balancing_routers(model: nn.Module) -> list[GlobalQuantileBalancingRouter]:
    """The :class:`GlobalQuantileBalancingRouter` modules of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, GlobalQuantileBalancingRouter)]


@torch.no_grad()
def solve_quantile_biases(routers: list[GlobalQuantileBalancingRouter]) -> None:
    """Sum every router's histograms over their ``stats_group`` in one all-reduce (a collective
    when the routers share statistics: every rank calls it, with the same routers), solve each
    bias (:meth:`GlobalQuantileBalancingRouter.solve_bias`) and empty the histograms."""
    if not routers:
        return
    groups = {id(r.context.stats_group) for r in routers}
    if len(groups) > 1:
        raise ValueError("the quantile-balancing routers of one model must share one stats_group")
    stacked_LER = torch.stack([r.histogram_ER for r in routers])
    group = routers[0].context.stats_group
    if group is not None:
        dist.all_reduce(stacked_LER, group=group)
    for r, histogram_ER in zip(routers, stacked_LER):
        r.solve_bias(histogram_ER)
        r.histogram_ER.zero_()


def register_quantile_balancing_hook(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Solve the biases of ``model``'s quantile-balancing routers before each ``optimizer.step()``
    (torchtitan's ``register_moe_quantile_balancing_hook``); their ``update_after_step`` then
    does nothing. Returns the hook's handle (``handle.remove()``), None without such a router."""
    routers = quantile_balancing_routers(model)
    if not routers:
        return None
    for r in routers:
        r.solved_by_hook = True
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: solve_quantile_biases(routers))
