"""``capacity_per_group`` takes a capacity factor > 0 only (0, a negative one and NaN are
refused, also where a router built by other code calls it), and gives C = ceil(cf * S * k / E)
within [1, S], worked by hand."""

from __future__ import annotations

import math

import pytest

from moe.routing import capacity_per_group


def test_capacity_factor_must_be_positive():
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            capacity_per_group(bad, 8, 2, 4)
    assert capacity_per_group(1.0, 8, 2, 4) == 4
    assert capacity_per_group(0.01, 8, 2, 4) == 1
    assert capacity_per_group(9.0, 8, 2, 4) == 8
    assert capacity_per_group(math.inf, 8, 2, 4) == 8
