"""Where the adversarial probe cuts a sequence of T positions: 0, T/4, T/2 and 3T/4 (0 and T/2
for a quick audit), distinct and at most T - 2, so that every cut leaves a future of at least
one position to fill. Worked by hand, the short sequences included."""

from __future__ import annotations

from moe.audit.probes import adversarial_cuts


def test_cuts_by_hand_each_leaving_a_future():
    assert adversarial_cuts(16) == [0, 4, 8, 12]
    assert adversarial_cuts(16, quick=True) == [0, 8]
    assert adversarial_cuts(4) == [0, 1, 2]  # 3T/4 = 3 would leave no future
    assert adversarial_cuts(3) == [0, 1]
    assert adversarial_cuts(2) == [0]
    assert all(max(adversarial_cuts(t)) <= t - 2 for t in range(2, 40))
