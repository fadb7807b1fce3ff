"""Argument checks shared by every configuration of the package: one wording for one mistake."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """``value`` if it is an int > 0 (bools refused), else ValueError naming ``name`` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def nonnegative_int(name: str, value) -> int:
    """``value`` if it is an int >= 0 (bools refused), else ValueError naming ``name`` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def first_few(names: list[str], most: int = 3) -> str:
    """The first ``most`` of ``names`` joined for a one-line message, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
