"""What a target returns, read as the audit compares it: every per-position tensor, by name.

Shape legend: B batch, T sequence, N = B * T flattened tokens, F features per position.

A target may return a tensor, a :class:`~moe.routing.Routing`, or a tuple / list / dict /
dataclass (transformers' ``ModelOutput`` is both of the last two) of them, nested. Every
tensor is named by its path (``logits``, ``router_logits.1``, ``0``; a bare tensor is
``output``) and read by its shape:

* [B, T, ...]: audited as it is;
* [N, ...] (``N = B * T``, the leading axis of ``x.view(-1, D)``, as Hugging Face MoE blocks
  return their router logits): audited as [B, T, ...], row n being token (n // T, n % T). A
  time-major flattening (row t * B + b, Megatron's [T, B] order) has the same shape; the
  engine tells the order with forwards that change one position alone
  (:mod:`moe.audit.flat_order`), and audits such a field in that order;
* [T, B, ...] with T != B: a time-major output the audit will not guess at: a usage error that
  names ``output=`` / ``--output`` (a time-major tensor is not told apart from [B, T, ...] when B == T);
* anything else (a scalar loss, a [B, D] pooled vector, per-expert counts): not per position,
  so no causality question: listed as not audited, with why;
* a field that is None (an output a block fills in only when asked) or not a tensor: listed as
  not audited, with why; the fields after it are read as any others;
* the key/value cache and attention weights of a ``ModelOutput`` (fields named in
  :data:`NOT_PER_POSITION`) are head-major: listed as not audited.

``select``: comma-separated names; a name keeps the field of that path and every field under it
(``router_logits`` keeps ``router_logits.0``, ``router_logits.1``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moe.routing import Routing

BARE = "output"
"""The name of a tensor or Routing returned on its own."""
NOT_PER_POSITION = frozenset(
    {"past_key_values", "attentions", "cross_attentions", "encoder_attentions", "decoder_attentions"}
)
"""``ModelOutput`` fields that are head-major ([B, H, T, ...]): never read as [B, T, ...]."""


class OutputError(ValueError):
    """The target's output cannot be read as the audit needs it (the message says what to pass)."""


@dataclass(frozen=True)
class Field:
    """One audited output of the target."""

    name: str
    value: Tensor | Routing
    flat: bool
    """Returned as [N, ...] and read as [B, T, ...]."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape; for a Routing, its dense weights' [B, T, E]."""
        if isinstance(self.value, Routing):
            return (*self.value.batch_shape, self.value.num_experts)
        return tuple(self.value.shape)


@dataclass(frozen=True)
class Skipped:
    """An output the audit does not compare, and why."""

    name: str
    shape: tuple[int, ...] | None
    why: str

    def text(self) -> str:
        shape = "" if self.shape is None else f" {list(self.shape)}"
        return f"{self.name}{shape} ({self.why})"


def _children(out: Any) -> list[tuple[str, Any]] | None:
    """(name, value) of a dict, a dataclass or a tuple / list; None for anything else."""
    if isinstance(out, Mapping):
        return [(str(k), v) for k, v in out.items()]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    if isinstance(out, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(out)]
    return None


def _leaves(out: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every tensor, Routing or other non-container leaf (None included), depth first, with its dotted path."""
    children = None if isinstance(out, (Tensor, Routing)) or out is None else _children(out)
    if children is None:
        yield path or BARE, out
        return
    for name, value in children:
        yield from _leaves(value, f"{path}.{name}" if path else name)


def _selected(name: str, select: list[str] | None) -> bool:
    return select is None or any(name == s or name.startswith(s + ".") for s in select)


def read_outputs(out: Any, b: int, t: int, select: str | None = None) -> tuple[list[Field], list[Skipped]]:
    """The fields of ``out`` the audit compares and those it does not, for an input [B=b, T=t].

    Raises :class:`OutputError` for an output with nothing to audit, a time-major field, a
    Routing of another shape, or a ``select`` name the output does not have."""
    wanted = None if select is None else [s.strip() for s in select.split(",") if s.strip()]
    leaves = list(_leaves(out, ""))
    if wanted is not None:
        names = [n for n, _ in leaves]
        missing = [s for s in wanted if not any(_selected(n, [s]) for n in names)]
        if missing:
            raise OutputError(
                f"the target's output ({type(out).__name__}) has no field {missing[0]!r}; it has: "
                f"{', '.join(names) or 'nothing'}"
            )
    fields: list[Field] = []
    skipped: list[Skipped] = []
    for name, value in leaves:
        if not _selected(name, wanted):
            skipped.append(Skipped(name, _shape(value), "not selected by --output (output=)"))
            continue
        top = name.split(".")[0]
        if top in NOT_PER_POSITION:
            skipped.append(Skipped(name, _shape(value), "a cache or attention weights: head-major, not per position"))
        elif isinstance(value, Routing):
            if tuple(value.batch_shape) != (b, t):
                raise OutputError(
                    f"the target's Routing {name!r} covers {tuple(value.batch_shape)}, the input is [B={b}, T={t}]"
                )
            fields.append(Field(name, value, flat=False))
        elif isinstance(value, Tensor):
            field, why = _read_tensor(name, value, b, t)
            if field is not None:
                fields.append(field)
            else:
                skipped.append(Skipped(name, tuple(value.shape), why))
        elif value is None:
            skipped.append(Skipped(name, None, "None: nothing returned in it"))
        else:
            skipped.append(Skipped(name, None, f"{type(value).__name__}, not a tensor"))
    if not fields:
        raise OutputError(_nothing_to_audit(out, skipped, b, t))
    return fields, skipped


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, Tensor):
        return tuple(value.shape)
    if isinstance(value, Routing):
        return tuple(value.batch_shape)
    return None


def _read_tensor(name: str, x: Tensor, b: int, t: int) -> tuple[Field | None, str]:
    shape = tuple(x.shape)
    if x.dim() >= 2 and shape[:2] == (b, t):
        return Field(name, x, flat=False), ""
    if x.dim() >= 1 and shape[0] == b * t:
        return Field(name, x, flat=True), ""
    if x.dim() >= 2 and shape[:2] == (t, b):
        raise OutputError(
            f"the target's output {name!r} has shape {shape}: time-major [T={t}, B={b}, ...]? The audit reads "
            "[B, T, ...] or [B * T, ...] outputs; transpose it in a wrapper, or leave it out with --output "
            "(output=) naming the fields to audit"
        )
    if x.dim() == 0:
        return None, "a scalar: a loss or a statistic of the whole batch"
    return None, f"not per position: no [B={b}, T={t}, ...] or [B*T={b * t}, ...] axes"


def _nothing_to_audit(out: Any, skipped: list[Skipped], b: int, t: int) -> str:
    if isinstance(out, Tensor):
        return (
            f"the target returned a tensor of shape {tuple(out.shape)} for an input of [B={b}, T={t}, ...]; the audit "
            "needs an output of shape [B, T, ...] (position t of the output belonging to input position t)"
        )
    if not skipped:
        return (
            f"the target returned {type(out).__name__}; it must return a tensor of shape [B, T, ...], a Routing, "
            "or a tuple / dict / dataclass holding one"
        )
    return (
        f"the target returned {type(out).__name__} with no [B={b}, T={t}, ...] output to audit; it has: "
        + "; ".join(s.text() for s in skipped)
    )
