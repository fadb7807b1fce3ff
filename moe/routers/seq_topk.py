"""Sequence-level top-k (SeqTopK, Wen et al., "Route Experts by Sequence, not by Token",
arXiv 2511.06494): each sequence's T*K best (token, expert) scores.

Shape legend: B batch, T sequence, N = B*T tokens, E experts, K experts per token on
average, P positions decoded so far, A kept assignments.

Top-k routing gives every token its K best experts. SeqTopK keeps the sequence's budget of
T*K assignments but spends it where the scores are highest: the softmax scores of the T
tokens are ranked together, over all T*E (token, expert) pairs, and the best T*K are kept,
so a token gets between 0 and E experts. Whether token t keeps an expert depends on the
scores of every other token of its sequence, the later ones included: not causal in either
mode (a leaking reference, like expert choice), and batch-invariant (the budget is per
sequence).

Decoding uses the paper's online variant with an expert cache: the decode state keeps the
scores of every token decoded so far, and the token at position p keeps the experts of its
row that fall among the best (p+1)*K of the cached scores of positions 0..p. That needs
nothing from the future, so decoding runs with the KV cache, but it is not what the
full-sequence forward (training's view) computes: the router claims not to be
decode-consistent, and :meth:`decode_support` allows decoding all the same.

Combine weights: the token's softmax scores of its kept experts, renormalised to sum to 1
(``normalize=True``, as top-k does here), or the scores themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.routing import Claims, DecodeState, Router, Routing, register_router, served_stats, slots_mask


@dataclass
class SeqTopKDecodeState(DecodeState):
    """The expert cache of online SeqTopK."""

    scores_BPE: Tensor | None = None
    """float [B, P, E]: the softmax scores of the P positions decoded so far."""


@register_router("seq_topk")
class SeqTopKRouter(Router):
    """The best T*K (token, expert) softmax scores of each sequence.

    Options: ``top_k`` (K: the budget per token on average, in [1, E]; default 2),
    ``normalize`` (renormalise a token's kept weights to sum to 1; default True),
    ``aux_loss_coef`` (Switch loss on the kept assignments), ``z_loss_coef``.
    """

    def __init__(self, d_model: int, num_experts: int, *, top_k: int = 2, normalize: bool = True, **base) -> None:
        super().__init__(d_model, num_experts, **base)
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")
        self.top_k = top_k
        self.normalize = bool(normalize)

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=False, causal_eval=False, batch_invariant=True, decode_consistent=False)

    def nominal_experts_per_token(self) -> float:
        return float(self.top_k)

    def decode_support(self) -> str | None:
        """None: the online variant decodes from the expert cache in either mode (it differs
        from the full-sequence forward; see the module docstring)."""
        return None

    def init_decode_state(self, batch_size: int) -> SeqTopKDecodeState:
        state = super().init_decode_state(batch_size)
        return SeqTopKDecodeState(state.batch_size)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        b, t = batch_shape
        e = self.num_experts
        probs_NE = F.softmax(logits_NE, dim=-1)
        best_BJ = torch.topk(probs_NE.detach().reshape(b, t * e), t * self.top_k, dim=-1).indices
        keep_NE = torch.zeros(b, t * e, dtype=torch.bool, device=logits_NE.device).scatter_(1, best_BJ, True)
        return self._routing(logits_NE, probs_NE, keep_NE.view(b * t, e), batch_shape)

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        b, t = batch_shape
        e, k = self.num_experts, self.top_k
        probs_NE = F.softmax(logits_NE, dim=-1)
        new_BTE = probs_NE.detach().view(b, t, e)
        cache_BPE = new_BTE.new_zeros(b, 0, e) if state.scores_BPE is None else state.scores_BPE
        keep_BTE = torch.zeros(b, t, e, dtype=torch.bool, device=logits_NE.device)
        for i in range(t):  # the token at absolute position p = P + i, after the i tokens before it
            cache_BPE = torch.cat([cache_BPE, new_BTE[:, i : i + 1]], 1)
            p = cache_BPE.shape[1]
            best_BJ = torch.topk(cache_BPE.reshape(b, p * e), p * k, dim=-1).indices
            mine_BJ = best_BJ >= (p - 1) * e  # the kept pairs in the newest row
            keep_BTE[:, i] = torch.zeros(b, e + 1, dtype=torch.bool, device=logits_NE.device).scatter_(
                1, torch.where(mine_BJ, best_BJ - (p - 1) * e, e), True
            )[:, :e]
        state.scores_BPE = cache_BPE
        return self._routing(logits_NE, probs_NE, keep_BTE.view(b * t, e), batch_shape)

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """The given (token, expert) pairs, weighted by the token's softmax scores of its given
        experts (renormalised over them, ``normalize``): token n's weights read token n alone,
        so a replayed forward reads no later token, whatever the sequence's budget chose. A
        decode state's expert cache is left as it was."""
        probs_NE = F.softmax(logits_NE, dim=-1)
        return self._routing(logits_NE, probs_NE, slots_mask(expert_NK, self.num_experts), batch_shape)

    def _routing(self, logits_NE: Tensor, probs_NE: Tensor, keep_NE: Tensor, batch_shape: tuple[int, int]) -> Routing:
        n, e = probs_NE.shape
        token_A, expert_A = keep_NE.nonzero(as_tuple=True)
        weight_NE = probs_NE * keep_NE  # dense, so each token's sum is a plain row reduction
        if self.normalize:
            weight_NE = weight_NE / weight_NE.sum(-1, keepdim=True).clamp_min(1e-20)
        weight_A = weight_NE[token_A, expert_A]
        return Routing(
            token=token_A,
            expert=expert_A,
            weight=weight_A,
            num_tokens=n,
            num_experts=e,
            aux_loss=self._aux_loss(logits_NE, probs_NE, expert_A),
            stats=served_stats(token_A, expert_A, n, e),
            batch_shape=batch_shape,
        )
