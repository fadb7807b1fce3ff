"""The scale a router weight's change is judged at (moe.audit.comparator.entry_scale)."""

import torch

from moe.audit.comparator import entry_scale


def test_a_token_whose_every_weight_is_small_is_judged_at_a_typical_tokens_scale():
    """A ReLU gate just above zero (ReMoE): the token's one weight, 0.045, carries the rounding of
    logits of the usual size, so its change is measured against the median token's largest
    weight (0.3), not its own; a token with a large weight keeps its own."""
    w_BTE = torch.tensor([[[0.4, 0.0, 0.1, 0.0], [0.0, 0.0, 0.045, 0.0], [0.0, 0.5, 0.0, 0.2], [0.3, 0.0, 0.0, 0.0]]])
    scale = entry_scale(w_BTE, w_BTE, row_max=True)
    # the row maxima 0.4, 0.045, 0.5, 0.3: torch.median takes the lower middle
    assert torch.equal(scale[0, 1], torch.full((4,), 0.3))
    assert torch.equal(scale[0, 2], torch.tensor([0.5, 0.5, 0.5, 0.5]))
    assert torch.equal(entry_scale(w_BTE, w_BTE)[0, 1], torch.tensor([0.0, 0.0, 0.045, 0.0]))  # features: row median


def test_an_empty_output_has_an_empty_scale():
    w = torch.zeros(2, 0, 4)
    assert entry_scale(w, w, row_max=True).shape == (2, 0, 4)
