"""An audit target behind one calling convention: call it, read its outputs, its claims, its state.

Shape legend: B batch, T sequence, D input features per position (flattened), F output
features per position (flattened), X exact decisions per position (routing masks of every
router call, or integer outputs), E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moe.audit.state import TargetState
from moe.layer import MoELayer
from moe.model import MoETransformer
from moe.routing import Claims, Router, Routing

DEFAULT_OUTPUT = "logits"
"""The field read from a dict / dataclass output when ``output`` is not given and it has one."""


class AuditUsageError(ValueError):
    """The target or its input cannot be audited as given (the message says what to fix)."""


@dataclass
class Outputs:
    """What one forward produced, split into what is compared with a tolerance and what exactly."""

    value_BTF: Tensor | None
    """Float outputs (a router's dense weights, a layer's output, logits) in float64; None if
    there are none. NaN and inf are kept: the comparator compares them as values."""
    exact_BTX: Tensor | None
    """Exact decisions: routing masks of every router call, or an integer / bool output."""
    dtype: torch.dtype | None = None
    """The dtype the target computed value_BTF in (its resolution sets the tolerance)."""

    def rows(self, start: int, stop: int) -> Outputs:
        """The outputs of samples start..stop-1 (for forwards that ran several copies at once)."""
        return Outputs(
            None if self.value_BTF is None else self.value_BTF[start:stop],
            None if self.exact_BTX is None else self.exact_BTX[start:stop],
            self.dtype,
        )


def _fields(out: Any) -> list[tuple[str, Any]] | None:
    """(name, value) of a dict, a dataclass (transformers' ModelOutput is both) or a tuple / list."""
    if isinstance(out, Mapping):
        return [(str(k), v) for k, v in out.items()]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    if isinstance(out, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(out)]
    return None


def select_output(out: Any, name: str | None = None) -> Tensor | Routing | None:
    """The output the audit reads: ``out`` itself when it is a tensor or a Routing; else the field
    ``name`` (a key, attribute or tuple index); else ``logits`` when present; else the first
    tensor or Routing, searched depth first. None when there is nothing to read."""
    if isinstance(out, (Tensor, Routing)):
        return out
    fields = _fields(out)
    if fields is None:
        return None
    if name is not None:
        named = dict(fields)
        if name not in named:
            raise AuditUsageError(
                f"the target's output ({type(out).__name__}) has no field {name!r}; it has: "
                f"{', '.join(k for k, v in fields if v is not None) or 'nothing'}"
            )
        return select_output(named[name])
    named = dict(fields)
    if isinstance(named.get(DEFAULT_OUTPUT), Tensor):
        return named[DEFAULT_OUTPUT]
    for _, item in fields:
        found = select_output(item)
        if found is not None:
            return found
    return None


def combine_claims(claims: list[Claims]) -> Claims:
    """A stack of routers is causal / batch-invariant only where every one of them is."""
    return Claims(
        causal_train=all(c.causal_train for c in claims),
        causal_eval=all(c.causal_eval for c in claims),
        batch_invariant=all(c.batch_invariant for c in claims),
        decode_consistent=all(c.decode_consistent for c in claims),
    )


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
        self.module = target if isinstance(target, nn.Module) else None
        self.routers: list[Router] = (
            [m for m in self.module.modules() if isinstance(m, Router)] if self.module is not None else []
        )
        self.ids_by_keyword = _takes_input_ids(target)
        self.autograd = False
        """Forwards run with gradients enabled and a float input that requires them (train mode)."""
        self.state = TargetState(self.module)
        """Its buffers reset before every forward, everything restored after (:mod:`moe.audit.state`)."""

    @property
    def claims(self) -> Claims | None:
        """The target's own ``claims``, else the AND of its routers' claims; None for an opaque target.

        An MoE layer or model without routers (dense) claims causal and batch-invariant.
        """
        own = getattr(self.module, "claims", None)
        if isinstance(own, Claims):
            return own
        if self.routers:
            return combine_claims([r.claims for r in self.routers])
        if isinstance(self.module, (MoELayer, MoETransformer)):
            return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)
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
    def _router_masks(self, masks: list[Tensor]) -> Iterator[None]:
        def hook(_module: nn.Module, _inputs: Any, out: Any) -> None:
            if isinstance(out, Routing):
                masks.append(out.mask())

        handles = [r.register_forward_hook(hook) for r in self.routers if r is not self.module]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _call(self, x: Tensor) -> Any:
        if self.ids_by_keyword and not x.is_floating_point():
            return self.fn(input_ids=x)
        return self.fn(x)

    def __call__(self, x: Tensor) -> Outputs:
        """Run the target on x [B, T, ...] (the caller's copy: the target may change it) and
        split its outputs (no gradients kept; in train mode the forward builds its graph, as a
        training step does, and the graph is dropped)."""
        masks: list[Tensor] = []
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

    def _outputs(self, out: Any, masks: list[Tensor], b: int, t: int, keep_graph: bool) -> Outputs:
        found = select_output(out, self.output)
        if found is None:
            raise AuditUsageError(
                f"the target returned {type(out).__name__}; it must return a tensor of shape [B, T, ...], "
                "a Routing, or a tuple / dict / dataclass holding one"
            )
        if isinstance(found, Routing):
            if found.batch_shape != (b, t):
                raise AuditUsageError(f"the target's Routing covers {found.batch_shape}, the input is [B={b}, T={t}]")
            value, exact = found.dense(), found.mask().reshape(b, t, -1)
        else:
            if found.dim() < 2 or tuple(found.shape[:2]) != (b, t):
                raise AuditUsageError(
                    f"the target returned a tensor of shape {tuple(found.shape)} for an input of [B={b}, T={t}, ...]; "
                    "the audit needs an output of shape [B, T, ...] (position t of the output belonging to input position t)"
                )
            value, exact = (found, None) if found.is_floating_point() else (None, found)
        dtype = value.dtype if value is not None else None
        if value is not None:
            value = value.reshape(b, t, -1)
            if not keep_graph:
                value = value.detach().double()
        exact_parts = [exact.reshape(b, t, -1).long()] if exact is not None else []
        exact_parts += [m.reshape(b, t, -1).long() for m in masks if m.shape[:2] == (b, t)]
        exact_BTX = torch.cat(exact_parts, dim=-1) if exact_parts else None
        return Outputs(value, exact_BTX, dtype)
