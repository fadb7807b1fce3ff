"""Combine weights of given choices, shared by the token-choice routers' ``replay``.

Shape legend: N tokens, E experts (X: E plus null experts), K slots of given experts per token
(-1 = empty), J the router's current choices per token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def slot_weights(probs_NX: Tensor, expert_NK: Tensor, normalize: bool, over_NJ: Tensor | None = None) -> Tensor:
    """float [N, K]: the scores ``probs_NX`` of the experts in ``expert_NK``'s slots (0 in empty
    ones), divided with ``normalize`` by their sum over the token's slots, or over the experts
    ``over_NJ`` when given (routers whose record lacks some choices: dropped, null). Top-k's
    combine weights, given the choices (``Router.replay``; R3, arXiv 2510.11370)."""
    weight_NK = torch.where(expert_NK >= 0, probs_NX.gather(1, expert_NK.clamp_min(0)), 0.0)
    if not normalize:
        return weight_NK
    mass_NK = weight_NK if over_NJ is None else probs_NX.gather(1, over_NJ)
    return weight_NK / mass_NK.sum(-1, keepdim=True).clamp_min(1e-20)


def weights_given_choices(
    expert_NK: Tensor, choice_NJ: Tensor, weight_NJ: Tensor, probs_NX: Tensor, normalize: bool
) -> Tensor:
    """float [N, K]: combine weights of the experts in ``expert_NK``'s slots for a router whose
    record lacks some of its choices (capacity drops, null experts). ``choice_NJ`` and
    ``weight_NJ`` are the router's current choices and their weights (normalised over them):
    a given expert among them keeps its own weight (the router's tensor itself, so a replay with
    unchanged weights is its forward bit for bit, gradients included); another gets its score,
    normalised (``normalize``) over the current choices as the router normalises them."""
    match_NKJ = expert_NK.unsqueeze(-1) == choice_NJ.unsqueeze(1)
    own_NK = weight_NJ.gather(1, match_NKJ.int().argmax(-1))
    other_NK = slot_weights(probs_NX, expert_NK, normalize, over_NJ=choice_NJ)
    return torch.where(match_NKJ.any(-1), own_NK, other_NK)
