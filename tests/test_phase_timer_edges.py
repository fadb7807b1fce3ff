"""``PhaseTimer.backward_split`` from stamps set by hand (no clock involved): each phase runs
from the previous boundary to its own mark, a mark that never fired ends its phase where it
began (zero), and a stamp earlier than the previous boundary counts zero, not a negative time.
"""

from moe.parallel.timing import PhaseTimer


def test_phases_run_between_consecutive_marks_and_the_last_to_the_end():
    timer = PhaseTimer()
    timer.stamps.update({"a": 12.0, "b": 15.5})
    split = timer.backward_split(10.0, 20.0, [("one", "a"), ("two", "b"), ("three", "")])
    assert split == {"one": 2.0, "two": 3.5, "three": 4.5}


def test_a_mark_that_never_fired_counts_zero_and_the_next_phase_starts_where_it_began():
    timer = PhaseTimer()
    timer.stamps.update({"b": 14.0})
    split = timer.backward_split(10.0, 20.0, [("one", "a"), ("two", "b"), ("three", "")])
    assert split == {"one": 0.0, "two": 4.0, "three": 6.0}


def test_a_stamp_before_the_previous_boundary_counts_zero():
    timer = PhaseTimer()
    timer.stamps.update({"a": 13.0, "b": 12.0})
    split = timer.backward_split(10.0, 20.0, [("one", "a"), ("two", "b"), ("three", "")])
    assert split == {"one": 3.0, "two": 0.0, "three": 8.0}


def test_a_phase_named_twice_adds_up():
    timer = PhaseTimer()
    timer.stamps.update({"a": 11.0, "b": 13.0})
    assert timer.backward_split(10.0, 16.0, [("x", "a"), ("y", "b"), ("x", "")]) == {"x": 4.0, "y": 2.0}
