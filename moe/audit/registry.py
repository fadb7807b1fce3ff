"""The probes the audit runs, by name: each declares its kind and how it makes its variants.

    from moe.audit.registry import Probe, register_probe
    register_probe(Probe("reversed_future", "future", variants=my_variants))   # runs in every audit after

A probe either makes ``variants`` (inputs the comparator judges against the example: these
count towards the significance level of the distribution regime, see
:func:`moe.audit.comparator.per_comparison_alpha`) or ``measure``-s its own result (the
Jacobian reads gradients). Its ``kind`` says what a leak means (:data:`moe.audit.report.KINDS`).
Within a mode the audit runs the "batch" probes first (whether perturbed copies may share a
forward depends on them), then the others in registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe.audit.comparator import Variant
from moe.audit.report import KINDS, ProbeResult

if TYPE_CHECKING:
    from moe.audit.context import ProbeContext


@dataclass(frozen=True)
class Probe:
    """One probe of the audit."""

    name: str
    """Unique; the ``name`` of its :class:`ProbeResult` rows."""
    kind: str
    """"future", "batch" or "decode": what its ``leaks`` means."""
    variants: Callable[[ProbeContext], Iterable[Variant]] | None = None
    """Inputs to compare with the example (their ``upto`` and ``rows`` say what is compared)."""
    measure: Callable[[ProbeContext], ProbeResult | None] | None = None
    """Instead of variants: the result itself (None: the probe does not apply to this target)."""
    stop_at_first: bool = False
    """Stop at the first forward that shows a change (the verdict is made; the positions reported
    are those seen until then): for probes whose many variants look for one change anywhere."""
    enough: int | None = None
    """Stop once this many variants were compared (those the target fails on do not count): the
    probe yields its preferred variants first and the rest as stand-ins (None: all of them)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a probe needs a non-empty name, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"probe {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.variants is None) == (self.measure is None):
            raise ValueError(f"probe {self.name!r}: give exactly one of variants= and measure=")

    @property
    def compares_forwards(self) -> bool:
        return self.variants is not None


_REGISTRY: dict[str, Probe] = {}


def register_probe(probe: Probe) -> Probe:
    """Add ``probe`` to every audit from now on; a name already registered is a ValueError."""
    if not isinstance(probe, Probe):
        raise ValueError(f"register_probe takes a Probe, got {type(probe).__name__}")
    if probe.name in _REGISTRY:
        raise ValueError(f"a probe named {probe.name!r} is already registered")
    _REGISTRY[probe.name] = probe
    return probe


def unregister_probe(name: str) -> None:
    """Remove the probe ``name``; an unknown name is a ValueError."""
    if name not in _REGISTRY:
        raise ValueError(f"no probe named {name!r}; registered: {', '.join(_REGISTRY)}")
    del _REGISTRY[name]


def registered_probes() -> tuple[Probe, ...]:
    """Every registered probe, in registration order (the built-in five first)."""
    return tuple(_REGISTRY.values())
