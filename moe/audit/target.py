"""An audit target behind one calling convention: call it, read its outputs (what a forward
returned, by name), its claims and its state (buffers reset before each forward, everything
restored after).

What a target returns, read as the audit compares it: every per-position tensor, by name.

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
  (:mod:`moe.audit.probes`), and audits such a field in that order;
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

A target module's state as the audit handles it: saved at the start, buffers reset before
every forward, everything restored at the end, and the attributes a forward changes outside its
parameters and buffers (state the audit cannot reset) found by comparing snapshots.

An audit target behind one calling convention: call it, read its outputs, its claims, its state.

Shape legend: B batch, T sequence, D input features per position (flattened), F output
features per position (flattened), X exact decisions per position (routing masks of every
router call, or integer outputs), E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moe.routing import Claims, Router, Routing, held_claims

BARE = "output"
"""The name of a tensor or Routing returned on its own."""
NOT_PER_POSITION = frozenset(
    {"past_key_values", "attentions", "cross_attentions", "encoder_attentions", "decoder_attentions"}
)
"""``ModelOutput`` fields that are head-major ([B, H, T, ...]): never read as [B, T, ...]."""


ROUTING_CLASS = re.compile(r"rout|expert|moe|mixture|gate$", re.IGNORECASE)
"""A class name that reads as routing: router, routed, expert, MoE, mixture, or ending in Gate
(fairseq's Top2Gate, fastmoe's NoisyGate, DeepSpeed's TopKGate)."""
ROUTING_PATH = re.compile(r"rout|expert|moe|mixture|(^|\.)(wg|w_gate|gate)$", re.IGNORECASE)
"""A submodule's or parameter's path that reads as routing: the words above, or an attribute
named gate, w_gate or wg (Hugging Face's, davidmrau's and fairseq's gate weights); not a gate
inside a name (xLSTM's igate, a SwiGLU's gate_proj)."""


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


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""Attributes every ``nn.Module`` has (parameters, buffers, hooks, the training flag): not the
target's own state."""


def _snapshot(value: Any) -> Any:
    """A copy of plain state (tensors, numbers, strings and containers of them) to compare later;
    anything else (functions, generators, submodules) as None."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (bool, int, float, complex, str, bytes)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_snapshot(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _snapshot(v) for k, v in value.items()}
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())  # NaN equals NaN here
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


class TargetState:
    """The state of ``module`` (None: a plain callable, which has none the audit can see)."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self.generators: list[torch.Generator] = (
            [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Generator)]
            if module is not None
            else []
        )
        """torch generators the target keeps as attributes: seeded before every forward like torch's own."""
        self._buffers: list[tuple[nn.Module, dict[str, Tensor], dict[int, Tensor]]] = []
        self._parameters: list[tuple[str, Tensor, Tensor]] = []
        """(name, parameter, its value at the start of the audit) of every parameter."""
        self._restored: list[tuple[Tensor, Tensor]] = []
        """(parameter, its value at the start) of those a forward was seen to change."""

    def reset(self) -> None:
        """Every buffer back to its value (and tensor object) from the start of the audit, and
        every parameter a forward was seen to change (:meth:`changed_parameters`) back to its
        value: run before every forward, so state a forward leaves behind never reaches the next
        one."""
        with torch.no_grad():
            for m, buffers, values in self._buffers:
                for name, t in buffers.items():
                    m._buffers[name] = t
                    if t is not None:
                        t.copy_(values[id(t)])
            for t, value in self._restored:
                t.copy_(value)

    def changed_buffers(self) -> list[str]:
        """Names of the buffers whose value differs from the start of the audit."""
        names = {id(m): n for n, m in self.module.named_modules()} if self.module is not None else {}
        out = []
        for m, buffers, values in self._buffers:
            for name, t in buffers.items():
                now = m._buffers.get(name)
                if t is not None and (now is not t or not torch.equal(t, values[id(t)])):
                    out.append(f"{names[id(m)]}.{name}".lstrip("."))
        return out

    def changed_parameters(self) -> list[str]:
        """Names of the parameters whose value differs from the start of the audit (a forward
        that updates one in place: a balancing bias kept as a parameter and moved in training).
        From then on each is restored before every forward (:meth:`reset`), as buffers are."""
        changed = [(name, t, value) for name, t, value in self._parameters if not _same(t.detach(), value)]
        known = {id(t) for t, _ in self._restored}
        self._restored += [(t, value) for _, t, value in changed if id(t) not in known]
        return [name for name, _, _ in changed]

    def hidden_state(self) -> dict[str, Any]:
        """The target's own attributes outside parameters, buffers and submodules (tensors,
        numbers, containers of them), by name: state a forward may change that no buffer holds."""
        if self.module is None:
            return {}
        return {
            f"{path}.{k}".lstrip("."): _snapshot(v)
            for path, m in self.module.named_modules()
            for k, v in vars(m).items()
            if k not in _MODULE_INTERNALS and not isinstance(v, (nn.Module, torch.Generator))
        }

    @staticmethod
    def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """The names whose value differs between two :meth:`hidden_state` snapshots."""
        return [k for k in sorted(before.keys() | after.keys()) if not _same(before.get(k), after.get(k))]

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Restore on exit, whatever the forwards did: every parameter and every buffer
        (persistent or not; the same tensor objects, with their values), buffers added or
        removed, the target's own generators and every training flag. Inside, the buffers'
        saved values are what :meth:`reset` restores before every forward (of the parameters,
        those a forward was seen to change)."""
        if self.module is None:
            yield
            return
        saved = []
        for m in self.module.modules():
            params, buffers = dict(m._parameters), dict(m._buffers)
            values = {id(t): t.detach().clone() for t in (*params.values(), *buffers.values()) if t is not None}
            saved.append((m, m.training, params, buffers, set(m._non_persistent_buffers_set), values))
        self._buffers = [(m, buffers, values) for m, _, _, buffers, _, values in saved]
        names = {id(m): n for n, m in self.module.named_modules()}
        self._parameters = [
            (f"{names[id(m)]}.{name}".lstrip("."), t, values[id(t)])
            for m, _, params, _, _, values in saved
            for name, t in params.items()
            if t is not None
        ]
        generator_states = [g.get_state() for g in self.generators]
        try:
            yield
        finally:
            self._buffers, self._parameters, self._restored = [], [], []
            for g, state in zip(self.generators, generator_states):
                g.set_state(state)
            with torch.no_grad():
                for m, training, params, buffers, non_persistent, values in saved:
                    m.training = training
                    m._parameters.clear()
                    m._parameters.update(params)
                    m._buffers.clear()
                    m._buffers.update(buffers)
                    m._non_persistent_buffers_set.clear()
                    m._non_persistent_buffers_set.update(non_persistent)
                    for t in (*params.values(), *buffers.values()):
                        if t is not None:
                            t.copy_(values[id(t)])


class AuditUsageError(ValueError):
    """The target or its input cannot be audited as given (the message says what to fix)."""


@dataclass(frozen=True)
class Part:
    """The columns one output (or one router's decisions) occupies in :class:`Outputs`."""

    name: str
    """The output's name (:mod:`moe.audit.target`), or "routing of NAME" for a router's hooked
    decisions."""
    exact: bool
    """Compared exactly (in ``exact_BTX``): routing masks and integer / bool outputs."""
    start: int
    stop: int
    dtype: torch.dtype | None = None
    """The dtype the target computed a float output in (its resolution sets the tolerance)."""
    weights: bool = False
    """A Routing's dense weights: each entry judged at its token's largest weight, not at the
    median of a row that is mostly zeros (:func:`~moe.audit.comparator.entry_scale`)."""


@dataclass
class Outputs:
    """What one forward produced, split into what is compared with a tolerance and what exactly."""

    value_BTF: Tensor | None
    """Float outputs (a router's dense weights, a layer's output, logits; several outputs side by
    side) in float64; None if there are none. NaN and inf are kept: the comparator compares them
    as values."""
    exact_BTX: Tensor | None
    """Exact decisions: routing masks of every router call, or integer / bool outputs."""
    dtype: torch.dtype | None = None
    """The coarsest dtype of the float outputs (None without float outputs)."""
    parts: tuple[Part, ...] = ()
    """Which columns of ``value_BTF`` / ``exact_BTX`` belong to which output."""

    def rows(self, start: int, stop: int) -> Outputs:
        """The outputs of samples start..stop-1 (for forwards that ran several copies at once)."""
        return Outputs(
            None if self.value_BTF is None else self.value_BTF[start:stop],
            None if self.exact_BTX is None else self.exact_BTX[start:stop],
            self.dtype,
            self.parts,
        )

    @property
    def float_parts(self) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if not p.exact)


def coarsest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The float dtype of largest eps among ``dtypes`` (None for none)."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)


def _requiring_grad(x: Tensor) -> tuple[Tensor, Tensor]:
    """(a leaf copy of float x that requires grad, a non-leaf copy of it to give the target): an
    input as a training step's layer sees it (``x.requires_grad``), which it may scale in place."""
    leaf = x.detach().clone().requires_grad_(True)
    return leaf, leaf.clone()


def _takes_input_ids(fn: Callable) -> bool:
    """Whether the target's forward has an ``input_ids`` parameter (Hugging Face style models)."""
    try:
        params = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn).parameters
    except (TypeError, ValueError):
        return False
    return "input_ids" in params


_NOT_THE_TARGETS = tuple(str(folder) + os.sep for folder in (Path(torch.__file__).parent, Path(__file__).parent))
"""Folders whose frames are not the target's own code: torch's package (an ``nn.Linear`` given the
wrong width raises in ``torch/nn/modules/linear.py``; an op under a ``with torch.device(...)`` mode or
``torch.compile`` raises in their wrappers) and the audit's."""


def raise_site(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the target's own code (the
    line that called into torch where torch raised), or the innermost frame where no frame is the
    target's."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not f.filename.startswith(_NOT_THE_TARGETS)]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


class AuditTarget:
    """Wraps an ``nn.Module`` or callable mapping [B, T, ...] inputs to [B, T, ...] outputs.

    Routers inside a module are hooked, so their assignments are compared exactly even when
    the target returns floats only (an MoE layer's output, a model's logits). Token ids go to
    a forward with an ``input_ids`` parameter by that keyword.
    """

    def __init__(self, target: Callable[[Tensor], Any], output: str | None = None) -> None:
        if not callable(target):
            raise AuditUsageError(f"the audit target must be an nn.Module or a callable, got {type(target).__name__}")
        self.fn = target
        self.output = output
        """Comma-separated output names to audit (None: every per-position output, :mod:`moe.audit.target`)."""
        self.module = target if isinstance(target, nn.Module) else None
        named = [(n, m) for n, m in self.module.named_modules() if isinstance(m, Router)] if self.module else []
        self.routers: list[Router] = [m for _, m in named]
        self._router_names = {id(m): n or type(m).__name__ for n, m in named}
        self.time_major: set[str] = set()
        """Flat [B*T, ...] outputs found to be flattened time-major (row t * B + b), see
        :func:`moe.audit.engine` (the check); the others are read as rows b * T + t."""
        self.audited: tuple[str, ...] = ()
        """The outputs the last forward gave for comparison, with their shapes (for the report)."""
        self.not_audited: tuple[Skipped, ...] = ()
        """The outputs of the last forward the audit does not compare, and why."""
        self.flat_fields: tuple[str, ...] = ()
        """The outputs of the last forward returned as [B * T, ...]."""
        self.per_position: dict[str, tuple[bool, tuple[int, ...]]] = {}
        """Per tensor output, as the first forward of two or more positions gave it: whether it was
        flat ([B * T, ...]) and the shape it holds per position."""
        self.not_per_position: dict[str, str] = {}
        """Outputs whose leading axes have the example's [B, T] (or B * T) sizes but do not follow the
        sequence's length (:func:`moe.audit.probes.check_lengths`), with why: listed as not audited."""
        self.float_parts: tuple[Part, ...] = ()
        """The float outputs of the last forward (their dtypes)."""
        self.ids_by_keyword = _takes_input_ids(target)
        self.autograd = False
        """Forwards run with gradients enabled and a float input that requires them (train mode)."""
        self.state = TargetState(self.module)
        """Its buffers reset before every forward, everything restored after (:mod:`moe.audit.target`)."""

    @property
    def claims(self) -> Claims | None:
        """The target's own ``claims`` (a :class:`~moe.routing.Claims`, as a router, ``MoELayer``
        and ``MoETransformer`` declare them, and any user's module may), else, for a module
        holding routers, each claim where every one of them makes it; None for an opaque target."""
        own = getattr(self.module, "claims", None)
        if isinstance(own, Claims):
            return own
        if self.routers:
            return held_claims(self.module)
        return None

    def routing_named(self) -> list[str] | None:
        """Its routers of ours, and its submodules and parameters whose name or class reads as
        routing (:data:`ROUTING_CLASS`, :data:`ROUTING_PATH`); None for a callable, which shows nothing to read."""
        if self.module is None:
            return None
        named = [(n, type(m).__name__) for n, m in self.module.named_modules()]
        named += [(n, "") for n, _ in self.module.named_parameters()]
        found = [n or c for n, c in named if ROUTING_PATH.search(n) or ROUTING_CLASS.search(c)]
        return list(dict.fromkeys(found + [self._router_names[id(r)] for r in self.routers]))

    def batch_statistics(self, mode: str) -> list[str]:
        """Its BatchNorm layers that normalise with the batch's own mean and variance in ``mode``
        (every one in training; in eval those that keep no running statistics)."""
        if self.module is None:
            return []
        return [
            n or type(m).__name__
            for n, m in self.module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and (mode == "train" or m.running_mean is None)
        ]

    def gate_vectors(self, d: int) -> list[Tensor]:
        """[E, D] gate weights of the routers that read D-wide features (the input space for a
        router or an MoE layer; deeper routers of a model read other features)."""
        return [r.gate.weight.detach() for r in self.routers if r.gate.in_features == d]

    def set_mode(self, mode: str) -> None:
        """Train mode is what a training step runs: ``module.train()`` and gradients enabled (code
        that picks its path by ``torch.is_grad_enabled()`` or ``x.requires_grad`` takes its
        training path); eval mode: ``module.eval()`` under ``torch.no_grad()``."""
        self.autograd = mode == "train"
        if self.module is not None:
            self.module.train(mode == "train")

    @contextlib.contextmanager
    def _router_masks(self, masks: list[tuple[str, Tensor]]) -> Iterator[None]:
        def hook(module: nn.Module, _inputs: Any, out: Any) -> None:
            if isinstance(out, Routing):
                masks.append((f"routing of {self._router_names[id(module)]}", out.mask()))

        handles = [r.register_forward_hook(hook) for r in self.routers if r is not self.module]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def plain(self, x: Tensor) -> Any:
        """The target's own eval forward on x under ``torch.no_grad()``, nothing read or hooked
        (what :func:`~moe.audit.runner.Runner.time_forward` times)."""
        with torch.no_grad():
            return self._call(x)

    def _call(self, x: Tensor) -> Any:
        if self.ids_by_keyword and not x.is_floating_point():
            return self.fn(input_ids=x)
        return self.fn(x)

    def __call__(self, x: Tensor) -> Outputs:
        """Run the target on x [B, T, ...] (the caller's copy: the target may change it) and
        split its outputs (no gradients kept; in train mode the forward builds its graph, as a
        training step does, and the graph is dropped)."""
        masks: list[tuple[str, Tensor]] = []
        b, t = x.shape[:2]
        with torch.set_grad_enabled(self.autograd), self._router_masks(masks):
            out = self._call(_requiring_grad(x)[1] if self.autograd and x.is_floating_point() else x)
        return self._outputs(out, masks, b, t, keep_graph=False)

    def forward_with_grad(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """(value_BTF with its graph, the float input it is differentiated against), or None where
        the target is not differentiable. The target gets a non-leaf copy of the float input, so
        it may scale it in place. Token ids are differentiated at the output of the embedding
        that reads them: the first ``nn.Embedding`` to read them; in a module without one, the
        first submodule that reads them as its first input and returns floats (an embedding of
        another library, as fairscale's ``ParallelEmbedding``)."""
        b, t = x.shape[:2]
        if x.is_floating_point():
            wrt, given = _requiring_grad(x)
            with torch.enable_grad():
                value = self._outputs(self._call(given), [], b, t, keep_graph=True).value_BTF
        else:
            if self.module is None:
                return None
            embeddings = [m for m in self.module.modules() if isinstance(m, nn.Embedding)]
            # without an nn.Embedding, any submodule reading the ids (fairscale's ParallelEmbedding)
            readers = embeddings or [m for m in self.module.modules() if m is not self.module]
            value, wrt = self._differentiated_at_embedding(x, readers)
            if wrt is None:
                return None
        if value is None or not value.requires_grad:
            return None
        return value, wrt

    def _differentiated_at_embedding(self, x: Tensor, readers: list[nn.Module]) -> tuple[Tensor | None, Tensor | None]:
        """(value_BTF with its graph, the float output of the first of ``readers`` to read the
        token ids ``x`` as its first input, made a leaf) or (None, None) if none of them did."""
        seen: list[Tensor] = []

        def leaf(_module: nn.Module, inputs: tuple, out: Any) -> Tensor | None:
            reads_x = bool(inputs) and isinstance(inputs[0], Tensor) and inputs[0].shape == x.shape
            floating = isinstance(out, Tensor) and out.is_floating_point()
            if not seen and reads_x and floating and torch.equal(inputs[0], x):
                seen.append(out.detach().requires_grad_(True))
                return seen[0].clone()
            return None

        handles = [m.register_forward_hook(leaf) for m in readers]
        try:
            with torch.enable_grad():
                value = self._outputs(self._call(x), [], x.shape[0], x.shape[1], keep_graph=True).value_BTF
        finally:
            for h in handles:
                h.remove()
        return (value, seen[0]) if seen else (None, None)

    def _outputs(self, out: Any, masks: list[tuple[str, Tensor]], b: int, t: int, keep_graph: bool) -> Outputs:
        """Every audited output side by side: float ones in ``value_BTF`` (float64, or with their
        graph when ``keep_graph``), exact ones and the hooked routers' masks in ``exact_BTX``."""
        try:
            fields, skipped = read_outputs(out, b, t, self.output)
        except OutputError as e:
            raise AuditUsageError(str(e)) from None
        skipped += [
            Skipped(f.name, f.shape, self.not_per_position[f.name]) for f in fields if f.name in self.not_per_position
        ]
        fields = [f for f in fields if f.name not in self.not_per_position]
        self._check_per_position(fields, b, t)
        values: list[tuple[str, Tensor]] = []
        exact: list[tuple[str, Tensor]] = []
        weights = {f.name for f in fields if isinstance(f.value, Routing)}
        for f in fields:
            if isinstance(f.value, Routing):
                values.append((f.name, f.value.dense()))
                exact.append((f"{f.name} (kept assignments)", f.value.mask()))
                continue
            v = f.value
            if f.flat and f.name in self.time_major:
                v = v.reshape(t, b, *v.shape[1:]).transpose(0, 1)
            elif f.flat:
                v = v.reshape(b, t, *v.shape[1:])
            (values if v.is_floating_point() else exact).append((f.name, v))
        exact += [(name, m) for name, m in masks if tuple(m.shape[:2]) == (b, t)]
        self.audited = tuple(self._describe(f.name, f.shape, f.flat) for f in fields)
        self.not_audited = tuple(skipped)
        self.flat_fields = tuple(f.name for f in fields if f.flat)
        parts: list[Part] = []
        value_BTF = exact_BTX = None
        if values:
            flat = [v.reshape(b, t, -1) for _, v in values]
            col = 0
            for (name, v), w in zip(values, flat):
                parts.append(Part(name, False, col, col + w.shape[-1], v.dtype, name in weights))
                col += w.shape[-1]
            wide = flat[0].dtype if len({w.dtype for w in flat}) == 1 else torch.float64
            value_BTF = torch.cat([w.to(wide) for w in flat], dim=-1) if len(flat) > 1 else flat[0]
            if not keep_graph:
                value_BTF = value_BTF.detach().double()
        if exact:
            flat = [m.reshape(b, t, -1).long() for _, m in exact]
            col = 0
            for (name, _), w in zip(exact, flat):
                parts.append(Part(name, True, col, col + w.shape[-1]))
                col += w.shape[-1]
            exact_BTX = torch.cat(flat, dim=-1)
        self.float_parts = tuple(p for p in parts if not p.exact)
        return Outputs(value_BTF, exact_BTX, coarsest([p.dtype for p in self.float_parts]), tuple(parts))

    def _check_per_position(self, fields: list[Field], b: int, t: int) -> None:
        """A field read flat now that was [B, T, ...] before must hold what it held per position:
        at T = 1 a [B, T', ...] output of another length T' (a weight of the example's length
        broadcast over a one-position input, lucidrains' non-causal gMLP) also has B * T rows."""
        for f in fields:
            if isinstance(f.value, Routing):
                continue
            shape = tuple(f.value.shape)
            held = shape[1:] if f.flat else shape[2:]
            if t >= 2:
                self.per_position.setdefault(f.name, (f.flat, held))
            first = self.per_position.get(f.name)
            if first is not None and f.flat and not first[0] and held != first[1]:
                raise AuditUsageError(
                    f"the target's output {f.name!r} has shape {shape} for an input [B={b}, T={t}]: its [B, T, ...] "
                    f"output held {list(first[1])} per position before, read as [B*T={b * t}, ...] it would hold "
                    f"{list(held)}"
                )

    def router_name(self, router: Router) -> str:
        """A router's path in the target (its class name for a router audited on its own)."""
        return self._router_names[id(router)]

    def _describe(self, name: str, shape: tuple[int, ...], flat: bool) -> str:
        """e.g. "router_logits.0 [64, 4] (rows b*T+t)"."""
        order = "" if not flat else " (rows t*B+b)" if name in self.time_major else " (rows b*T+t)"
        return f"{name} {list(shape)}{order}"
