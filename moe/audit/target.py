"""An audit target behind one calling convention: run it, read its outputs, its claims, its state.

Shape legend: B batch, T sequence, D input features per position (flattened), F output
features per position (flattened), X exact decisions per position (routing masks of every
router call, or integer outputs), E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from moe.layer import MoELayer
from moe.model import MoETransformer
from moe.routing import Claims, Router, Routing


class AuditUsageError(ValueError):
    """The target or its input cannot be audited as given (the message says what to fix)."""


@dataclass
class Outputs:
    """What one forward produced, split into what is compared with a tolerance and what exactly."""

    value_BTF: Tensor | None
    """Float outputs (a router's dense weights, a layer's output, logits); None if there are none."""
    exact_BTX: Tensor | None
    """Exact decisions: routing masks of every router call, or an integer / bool output."""
    dtype: torch.dtype | None = None
    """The dtype the target computed value_BTF in (value_BTF itself is held in float64)."""

    def rows(self, start: int, stop: int) -> Outputs:
        """The outputs of samples start..stop-1 (for forwards that ran several copies at once)."""
        return Outputs(
            None if self.value_BTF is None else self.value_BTF[start:stop],
            None if self.exact_BTX is None else self.exact_BTX[start:stop],
            self.dtype,
        )


def first_output(out: Any) -> Tensor | Routing | None:
    """The output the audit reads: a tensor or Routing, else the first one in a tuple / list / dataclass."""
    if isinstance(out, (Tensor, Routing)):
        return out
    if isinstance(out, (tuple, list)):
        items = out
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        return None
    for item in items:
        found = first_output(item)
        if found is not None:
            return found
    return None


def combine_claims(claims: list[Claims]) -> Claims:
    """A stack of routers is causal / batch-invariant only where every one of them is."""
    return Claims(
        causal_train=all(c.causal_train for c in claims),
        causal_eval=all(c.causal_eval for c in claims),
        batch_invariant=all(c.batch_invariant for c in claims),
    )


class AuditTarget:
    """Wraps an ``nn.Module`` or callable mapping [B, T, ...] inputs to [B, T, ...] outputs.

    Routers inside a module are hooked, so their assignments are compared exactly even when
    the target returns floats only (an MoE layer's output, a model's logits).
    """

    def __init__(self, target: Callable[[Tensor], Any]) -> None:
        if not callable(target):
            raise AuditUsageError(f"the audit target must be an nn.Module or a callable, got {type(target).__name__}")
        self.fn = target
        self.module = target if isinstance(target, nn.Module) else None
        self.routers: list[Router] = (
            [m for m in self.module.modules() if isinstance(m, Router)] if self.module is not None else []
        )

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
            return Claims(causal_train=True, causal_eval=True, batch_invariant=True)
        return None

    def gate_vectors(self, d: int) -> list[Tensor]:
        """[E, D] gate weights of the routers that read D-wide features (the input space for a
        router or an MoE layer; deeper routers of a model read other features)."""
        return [r.gate.weight.detach() for r in self.routers if r.gate.in_features == d]

    def set_mode(self, mode: str) -> None:
        if self.module is not None:
            self.module.train(mode == "train")

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Restore every parameter, buffer and training flag on exit, whatever the probes did."""
        if self.module is None:
            yield
            return
        state = {k: v.detach().clone() for k, v in self.module.state_dict(keep_vars=True).items()}
        flags = [(m, m.training) for m in self.module.modules()]
        try:
            yield
        finally:
            with torch.no_grad():
                self.module.load_state_dict(state)
            for m, flag in flags:
                m.training = flag

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

    def __call__(self, x: Tensor) -> Outputs:
        """Run the target on x [B, T, ...] and split its outputs (no gradients kept)."""
        masks: list[Tensor] = []
        with torch.no_grad(), self._router_masks(masks):
            out = self.fn(x)
        return self._outputs(out, masks, x.shape[0], x.shape[1], keep_graph=False)

    def forward_with_grad(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """(value_BTF with its graph, the float input it is differentiated against), or None where
        the target is not differentiable. Token ids are differentiated at the output of the
        embedding that reads them."""
        b, t = x.shape[:2]
        if x.is_floating_point():
            wrt = x.detach().clone().requires_grad_(True)
            with torch.enable_grad():
                value = self._outputs(self.fn(wrt), [], b, t, keep_graph=True).value_BTF
        else:
            if self.module is None:
                return None
            seen: list[Tensor] = []

            def leaf(_module: nn.Module, inputs: tuple, out: Tensor) -> Tensor | None:
                reads_x = bool(inputs) and isinstance(inputs[0], Tensor) and inputs[0].shape == x.shape
                if not seen and reads_x and torch.equal(inputs[0], x) and out.is_floating_point():
                    seen.append(out.detach().requires_grad_(True))
                    return seen[0]
                return None

            handles = [m.register_forward_hook(leaf) for m in self.module.modules() if isinstance(m, nn.Embedding)]
            try:
                with torch.enable_grad():
                    value = self._outputs(self.fn(x), [], b, t, keep_graph=True).value_BTF
            finally:
                for h in handles:
                    h.remove()
            if not seen:
                return None
            wrt = seen[0]
        if value is None or not value.requires_grad:
            return None
        return value, wrt

    @staticmethod
    def _outputs(out: Any, masks: list[Tensor], b: int, t: int, keep_graph: bool) -> Outputs:
        found = first_output(out)
        if found is None:
            raise AuditUsageError(
                f"the target returned {type(out).__name__}; it must return a tensor of shape [B, T, ...], "
                "a Routing, or a tuple / dataclass whose first tensor is one"
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
