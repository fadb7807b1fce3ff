"""A target module's state as the audit handles it: saved at the start, buffers reset before
every forward, everything restored at the end, and the attributes a forward changes outside its
parameters and buffers (state the audit cannot reset) found by comparing snapshots.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

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
        both = isinstance(a, Tensor) and isinstance(b, Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
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

    def reset_buffers(self) -> None:
        """Every buffer back to its value (and tensor object) from the start of the audit: run
        before every forward, so state a forward leaves behind never reaches the next one."""
        with torch.no_grad():
            for m, buffers, values in self._buffers:
                for name, t in buffers.items():
                    m._buffers[name] = t
                    if t is not None:
                        t.copy_(values[id(t)])

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
        saved values are what :meth:`reset_buffers` restores before every forward."""
        if self.module is None:
            yield
            return
        saved = []
        for m in self.module.modules():
            params, buffers = dict(m._parameters), dict(m._buffers)
            values = {id(t): t.detach().clone() for t in (*params.values(), *buffers.values()) if t is not None}
            saved.append((m, m.training, params, buffers, set(m._non_persistent_buffers_set), values))
        self._buffers = [(m, buffers, values) for m, _, _, buffers, _, values in saved]
        generator_states = [g.get_state() for g in self.generators]
        try:
            yield
        finally:
            self._buffers = []
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
