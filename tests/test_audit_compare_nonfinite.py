"""The comparator compares NaN and inf as values (``moe.audit.comparator``'s docstring): where
both forwards hold NaN (or the same inf) nothing changed; where the NaN / inf pattern changes,
that entry is a flip at its position. Worked by hand on a 1 x 4 x 3 output."""

from __future__ import annotations

import math

import torch

from moe.audit.comparator import compare
from moe.audit.target import Outputs, Part

PARTS = (Part("y", False, 0, 3, torch.float64),)


def outputs(value_BTF: torch.Tensor) -> Outputs:
    return Outputs(value_BTF, None, torch.float64, PARTS)


def test_nan_and_inf_in_both_forwards_are_no_change_and_a_changed_pattern_is_a_flip():
    ref_BTF = torch.arange(12, dtype=torch.float64).view(1, 4, 3)
    ref_BTF[0, 1, 0] = math.nan
    ref_BTF[0, 2, 1] = math.inf
    d = compare(outputs(ref_BTF), outputs(ref_BTF.clone()), 1, [4])
    assert d.flips_PS.tolist() == [[0, 0, 0, 0]] and d.excess_PS.tolist() == [[0.0] * 4]
    moved_BTF = ref_BTF.clone()
    moved_BTF[0, 1, 0] = 1.0  # NaN -> a number: a flip at position 1
    moved_BTF[0, 3, 2] = -math.inf  # a number -> -inf: a flip at position 3
    d = compare(outputs(ref_BTF), outputs(moved_BTF), 1, [4])
    assert d.flips_PS.tolist() == [[0, 1, 0, 1]] and d.excess_PS.tolist() == [[0.0] * 4]
