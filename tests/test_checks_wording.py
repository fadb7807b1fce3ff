"""``moe.checks``: the shared argument checks and message helper, worked by hand at their edges
(exactly ``most`` names, a bool where an int is wanted, zero)."""

from __future__ import annotations

import pytest

from moe.checks import first_few, nonnegative_int, positive_int


def test_first_few_names_the_rest_only_when_there_are_more():
    assert first_few([]) == ""
    assert first_few(["a", "b", "c"]) == "a, b, c"
    assert first_few(["a", "b", "c", "d"]) == "a, b, c and 1 more"
    assert first_few(["a", "b", "c", "d", "e"], most=2) == "a, b and 3 more"


def test_int_checks_refuse_bools_and_take_their_bounds():
    assert positive_int("n", 1) == 1 and nonnegative_int("n", 0) == 0
    for check, bad in ((positive_int, 0), (positive_int, True), (nonnegative_int, -1), (nonnegative_int, False)):
        with pytest.raises(ValueError, match=rf"^n must be .*, got {bad!r}$"):
            check("n", bad)
    with pytest.raises(ValueError, match="got 2.0"):
        nonnegative_int("n", 2.0)
