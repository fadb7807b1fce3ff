"""Combine weights of given choices: shared by the top-k routers' selection and their ``replay``.

Shape legend: N tokens, X experts (E, or E plus null experts), K slots of given experts per
token (-1 = empty), J the router's current choices per token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def slot_softmax(logits_NX: Tensor, expert_NK: Tensor) -> Tensor:
    """float [N, K]: the softmax over the logits of the experts in ``expert_NK``'s slots alone,
    0 in the empty ones: the combine weights of a top-k taken before the softmax (Megatron-Core's
    ``topk_routing_with_score_function`` with ``use_pre_softmax`` off; quantile balancing), for
    the router's own choices or for given ones (``Router.replay``; R3, arXiv 2510.11370)."""
    filled_NK = expert_NK >= 0
    chosen_NK = logits_NX.gather(1, expert_NK.clamp_min(0)).masked_fill(~filled_NK, float("-inf"))
    return torch.softmax(chosen_NK, dim=-1).masked_fill(~filled_NK, 0.0)


def weights_given_choices(expert_NK: Tensor, choice_NJ: Tensor, weight_NJ: Tensor, other_NK: Tensor) -> Tensor:
    """float [N, K]: combine weights of the experts in ``expert_NK``'s slots for a router whose
    record lacks some of its choices (capacity drops, null experts). ``choice_NJ`` and
    ``weight_NJ`` are the router's current choices and their weights: a given expert among them
    keeps its own weight (the router's tensor itself, so a replay with unchanged weights is its
    forward bit for bit, gradients included); another gets ``other_NK``, the weight the router's
    formula gives it beside the current choices."""
    match_NKJ = expert_NK.unsqueeze(-1) == choice_NJ.unsqueeze(1)
    own_NK = weight_NJ.gather(1, match_NKJ.int().argmax(-1))
    return torch.where(match_NKJ.any(-1), own_NK, other_NK)
