"""``Routing`` refuses fields that cannot describe one forward: token, expert and weight of
different lengths, a ``valid`` mask that is not bool [A], and a ``batch_shape`` (B, T) whose
product is not ``num_tokens``; a missing ``batch_shape`` is one sequence of N tokens."""

from __future__ import annotations

import pytest
import torch

from moe.routing import Routing


def routing(**fields) -> Routing:
    base = dict(
        token=torch.tensor([0, 1, 5]),
        expert=torch.tensor([1, 0, 2]),
        weight=torch.tensor([0.5, 1.0, 0.25]),
        num_tokens=6,
        num_experts=3,
        aux_loss=torch.zeros(()),
    )
    return Routing(**{**base, **fields})


def test_fields_that_describe_no_forward_are_refused():
    assert routing().batch_shape == (1, 6)
    assert routing(batch_shape=(2, 3)).dense().shape == (2, 3, 3)
    for shape in ((2, 2), (3, 3), (1, 5), (6, 6)):
        with pytest.raises(ValueError, match="does not multiply to num_tokens 6"):
            routing(batch_shape=shape)
    with pytest.raises(ValueError, match="equal length"):
        routing(weight=torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        routing(valid=torch.tensor([1, 0, 1]))
