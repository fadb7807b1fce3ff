"""``Routing`` refuses fields that cannot describe one forward: token, expert and weight of
different lengths, a ``valid`` mask that is not bool [A], and a ``batch_shape`` (B, T) whose
product is not ``num_tokens``; a missing ``batch_shape`` is one sequence of N tokens. The
``dropped_fraction`` stat and the balance losses' ``fractions`` by hand at their edges."""

from __future__ import annotations

import pytest
import torch

from moe.routing import Routing, dropped_fraction, fractions


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


def test_dropped_fraction_is_the_share_of_slots_left_empty_and_never_below_zero():
    """1 - kept / slots, 0 where more were kept than the nominal slots (a replayed record with more
    experts than top_k) or where there are no slots; the same for a count held in a tensor."""
    cpu = torch.device("cpu")
    for kept, slots, want in ((3, 4, 0.25), (4, 4, 0.0), (6, 4, 0.0), (0, 4, 1.0), (2, 0, 0.0)):
        assert float(dropped_fraction(kept, slots, cpu)) == want, (kept, slots)
        assert float(dropped_fraction(torch.tensor(kept), slots, cpu)) == want, (kept, slots)


def test_fractions_divide_each_row_by_its_sum_and_leave_empty_rows_zero():
    """A sequence that kept no assignment has a row of zero counts: its fractions are 0, not NaN."""
    got = fractions(torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, 0.0]]))
    assert got.tolist() == [[0.0, 0.0, 0.0], [0.25, 0.75, 0.0]]
