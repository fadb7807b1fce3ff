"""The positions the flat-output order check changes in turn: T-1, T-2, T-3 and T/2, latest
first, distinct, at most ORDER_POSITIONS, and never 0 (a change at position 0 may move every
row, which tells no order). Worked by hand, short sequences included."""

from __future__ import annotations

from moe.audit.probes import order_positions


def test_order_positions_by_hand_never_zero():
    assert order_positions(16) == [15, 14, 13, 8]
    assert order_positions(6) == [5, 4, 3]
    assert order_positions(3) == [2, 1]
    assert order_positions(2) == [1]
    assert all(0 not in order_positions(t) for t in range(2, 40))
