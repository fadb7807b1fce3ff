"""An audit target behind one calling convention: call it, read its outputs, its claims, its state.

Shape legend: B batch, T sequence, D input features per position (flattened), F output
features per position (flattened), X exact decisions per position (routing masks of every
router call, or integer outputs), E experts.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moe.audit.outputs import OutputError, Skipped, read_outputs
from moe.audit.state import TargetState
from moe.routing import Claims, Router, Routing, held_claims


class AuditUsageError(ValueError):
    """The target or its input cannot be audited as given (the message says what to fix)."""


@dataclass(frozen=True)
class Part:
    """The columns one output (or one router's decisions) occupies in :class:`Outputs`."""

    name: str
    """The output's name (:mod:`moe.audit.outputs`), or "routing of NAME" for a router's hooked
    decisions."""
    exact: bool
    """Compared exactly (in ``exact_BTX``): routing masks and integer / bool outputs."""
    start: int
    stop: int
    dtype: torch.dtype | None = None
    """The dtype the target computed a float output in (its resolution sets the tolerance)."""
    weights: bool = False
    """A Routing's dense weights: each entry judged at its token's largest weight, not at the
    median of a row that is mostly zeros (:func:`~moe.audit.calibration.entry_scale`)."""


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


def raise_site(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback (where it was raised)."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


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
        """Comma-separated output names to audit (None: every per-position output, :mod:`moe.audit.outputs`)."""
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
        self.float_parts: tuple[Part, ...] = ()
        """The float outputs of the last forward (their dtypes)."""
        self.ids_by_keyword = _takes_input_ids(target)
        self.autograd = False
        """Forwards run with gradients enabled and a float input that requires them (train mode)."""
        self.state = TargetState(self.module)
        """Its buffers reset before every forward, everything restored after (:mod:`moe.audit.state`)."""

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
        that reads them."""
        b, t = x.shape[:2]
        if x.is_floating_point():
            wrt, given = _requiring_grad(x)
            with torch.enable_grad():
                value = self._outputs(self._call(given), [], b, t, keep_graph=True).value_BTF
        else:
            if self.module is None:
                return None
            seen: list[Tensor] = []

            def leaf(_module: nn.Module, inputs: tuple, out: Tensor) -> Tensor | None:
                reads_x = bool(inputs) and isinstance(inputs[0], Tensor) and inputs[0].shape == x.shape
                if not seen and reads_x and torch.equal(inputs[0], x) and out.is_floating_point():
                    seen.append(out.detach().requires_grad_(True))
                    return seen[0].clone()
                return None

            handles = [m.register_forward_hook(leaf) for m in self.module.modules() if isinstance(m, nn.Embedding)]
            try:
                with torch.enable_grad():
                    value = self._outputs(self._call(x), [], b, t, keep_graph=True).value_BTF
            finally:
                for h in handles:
                    h.remove()
            if not seen:
                return None
            wrt = seen[0]
        if value is None or not value.requires_grad:
            return None
        return value, wrt

    def _outputs(self, out: Any, masks: list[tuple[str, Tensor]], b: int, t: int, keep_graph: bool) -> Outputs:
        """Every audited output side by side: float ones in ``value_BTF`` (float64, or with their
        graph when ``keep_graph``), exact ones and the hooked routers' masks in ``exact_BTX``."""
        try:
            fields, skipped = read_outputs(out, b, t, self.output)
        except OutputError as e:
            raise AuditUsageError(str(e)) from None
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

    def router_name(self, router: Router) -> str:
        """A router's path in the target (its class name for a router audited on its own)."""
        return self._router_names[id(router)]

    def _describe(self, name: str, shape: tuple[int, ...], flat: bool) -> str:
        """e.g. "router_logits.0 [64, 4] (rows b*T+t)"."""
        order = "" if not flat else " (rows t*B+b)" if name in self.time_major else " (rows b*T+t)"
        return f"{name} {list(shape)}{order}"
