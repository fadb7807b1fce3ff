"""A target's random draws fixed at their medians, so its routing rule can be audited without the
noise that hides it.

Noise makes some leaks too small to test: a random choice among an overfull expert's tokens
(pjlab-sys4nlp/llama-moe's ``SwitchDropTokenCalculator`` keeps a ``torch.randperm`` subset of
them over the flattened batch) behind a Gumbel-sampled gate moves one earlier token's chance of
being dropped by a few points when the future changes, which no test of a few dozen draws sees.
With every draw fixed the same rule is deterministic and a leak of the rule shows in every
comparison. :class:`FixedDraws` is a dispatch mode that lets each seeded random op of torch run
(its generator advances as before) and then overwrites what it drew with the median of its law:
a uniform draw the middle of its range, a Gaussian its mean, an exponential ln 2 / lambda, a
Bernoulli 1 where p >= 1/2, integers the middle of their range, a permutation the identity, a
multinomial sample the likeliest categories, dropout's mask all kept where p <= 1/2 (all dropped
above). An op it does not know is left drawing (:attr:`FixedDraws.unknown` names it).

Python's ``random`` and NumPy's global generator pass no dispatch mode: :func:`host_medians`
replaces their common draws (the module functions, looked up when called) for as long as it is
entered, numbers by the middle of their range or their mean, an order by the identity (``shuffle``
leaves the sequence as it is, ``permutation`` is ``arange``), a choice by the first elements of
the population (NumPy's by the likeliest where ``p`` is given). StableMoE's greedy balanced
assignment takes its experts in an ``np.random.shuffle`` order. A draw through another function
still moves its generator, and the runner, which watches where the generators are left, says so.

Shape legend: K categories of a multinomial, S samples drawn.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    """An op's argument by position or by keyword."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def _fill(out: Tensor, value: Any) -> Tensor:
    """``out`` holding ``value`` (a number, or a tensor broadcast to it), in its own dtype."""
    value = value if isinstance(value, Tensor) else torch.tensor(value, dtype=torch.float64)
    out.copy_(value.to(out.device).expand_as(out).to(out.dtype))
    return out


def _multinomial(probs: Tensor, samples: int, out: Tensor) -> Tensor:
    """The ``samples`` likeliest categories of each row, likeliest first (the likeliest repeated
    where more are drawn than there are categories)."""
    order_K = probs.argsort(dim=-1, descending=True, stable=True)
    picked = order_K[..., :samples] if samples <= probs.shape[-1] else order_K[..., :1].expand(*out.shape)
    return out.copy_(picked)


def _middle(low: int, high: int) -> int:
    """The middle integer of [low, high)."""
    return low + (high - low - 1) // 2


def _random_median(args: tuple, kwargs: dict) -> int:
    """``random_(from, to)``: the middle integer of [from, to); ``random_(to)``: of [0, to); 0 without a range."""
    low, high = (args[1], args[2]) if len(args) > 2 else (0, args[1]) if len(args) > 1 else (0, 1)
    low, high = kwargs.get("from", low), kwargs.get("to", high)
    return _middle(low, high) if high is not None else low


def _randint_median(name: str, args: tuple, kwargs: dict) -> int:
    """``randint(high, size)``, ``randint(low, high, size)`` and their ``_like`` forms: the middle
    integer of [low, high)."""
    numbers = [a for a in (args[1:] if name == "randint_like" else args) if isinstance(a, int)]
    low, high = (0, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1])
    return _middle(kwargs.get("low", low), kwargs.get("high", high))


def _dropout(args: tuple, out: tuple) -> tuple:
    """``native_dropout(x, p, train)``: every element kept (x / (1 - p)) where p <= 1/2, else none."""
    x, p = args[0], float(args[1])
    keep = p <= 0.5
    out[1].fill_(keep)
    _fill(out[0], x / (1 - p) if keep else 0.0)
    return out


def _median(name: str, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` (what the op ``name`` drew) overwritten with its law's median; None for an op not known."""
    if name == "native_dropout":
        return _dropout(args, out) if _arg(args, kwargs, 2, "train", True) else out
    first = args[0] if args else None
    medians = {
        "uniform_": lambda: (_arg(args, kwargs, 1, "from", 0.0) + _arg(args, kwargs, 2, "to", 1.0)) / 2,
        "normal_": lambda: _arg(args, kwargs, 1, "mean", 0.0),
        "normal": lambda: first if first is not None else kwargs["mean"],
        "exponential_": lambda: math.log(2) / _arg(args, kwargs, 1, "lambd", 1.0),
        "cauchy_": lambda: _arg(args, kwargs, 1, "median", 0.0),
        "log_normal_": lambda: math.exp(_arg(args, kwargs, 1, "mean", 1.0)),
        "geometric_": lambda: max(1, math.ceil(-math.log(2) / math.log1p(-_arg(args, kwargs, 1, "p", 0.5)))),
        "bernoulli_": lambda: torch.as_tensor(_arg(args, kwargs, 1, "p", 0.5)) >= 0.5,
        "bernoulli": lambda: torch.as_tensor(_arg(args, kwargs, 1, "p", first)) >= 0.5,
        "random_": lambda: _random_median(args, kwargs),
        "rand": lambda: 0.5,
        "rand_like": lambda: 0.5,
        "randn": lambda: 0.0,
        "randn_like": lambda: 0.0,
        "randint": lambda: _randint_median("randint", args, kwargs),
        "randint_like": lambda: _randint_median("randint_like", args, kwargs),
        "randperm": lambda: torch.arange(out.numel()),
        "poisson": lambda: torch.floor(first + 1 / 3),
        "binomial": lambda: torch.floor(first * _arg(args, kwargs, 1, "prob", 0.5)),
    }
    if name == "multinomial":
        return _multinomial(first, _arg(args, kwargs, 1, "num_samples", 1), out)
    if name not in medians:
        return None
    return _fill(out, medians[name]())


class FixedDraws(TorchDispatchMode):
    """Every seeded random op of torch run, then what it drew overwritten with its law's median
    (the module docstring); ops it does not know keep their draws and are named in :attr:`unknown`."""

    def __init__(self) -> None:
        super().__init__()
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return out
        name = func._overloadpacket.__name__
        fixed = _median(name, args, kwargs, out)
        if fixed is None:
            self.unknown.add(name)
            return out
        return fixed


def _numpy_medians(np: Any) -> dict[str, Any]:
    """NumPy's global-generator draws at their medians (the module docstring)."""

    def full(size: Any, value: Any) -> Any:
        return value if size is None else np.full(size, value)

    def randint(low: int, high: int | None = None, size: Any = None, dtype: Any = int) -> Any:
        value = _middle(0, low) if high is None else _middle(low, high)
        return np.dtype(dtype).type(value) if size is None else np.full(size, value, dtype=dtype)

    def choice(a: Any, size: Any = None, replace: bool = True, p: Any = None) -> Any:
        population = np.arange(a) if isinstance(a, int) else np.asarray(a)
        order = np.arange(len(population)) if p is None else np.argsort(-np.asarray(p), kind="stable")
        count = 1 if size is None else int(np.prod(size))
        picked = population[np.resize(order, count) if count > len(order) else order[:count]]
        return picked[0] if size is None else picked.reshape(size)

    return {
        "rand": lambda *dims: full(dims or None, 0.5),
        "randn": lambda *dims: full(dims or None, 0.0),
        "random": lambda size=None: full(size, 0.5),
        "random_sample": lambda size=None: full(size, 0.5),
        "uniform": lambda low=0.0, high=1.0, size=None: full(size, (low + high) / 2),
        "normal": lambda loc=0.0, scale=1.0, size=None: full(size, loc),
        "standard_normal": lambda size=None: full(size, 0.0),
        "randint": randint,
        "permutation": lambda x: np.arange(x) if isinstance(x, int) else np.array(x),
        "shuffle": lambda x: None,
        "choice": choice,
    }


_PYTHON_MEDIANS: dict[str, Any] = {
    "random": lambda: 0.5,
    "uniform": lambda a, b: (a + b) / 2,
    "gauss": lambda mu=0.0, sigma=1.0: mu,
    "normalvariate": lambda mu=0.0, sigma=1.0: mu,
    "randint": lambda a, b: _middle(a, b + 1),
    "randrange": lambda start, stop=None, step=1: (r := range(0, start) if stop is None else range(start, stop, step))[
        (len(r) - 1) // 2
    ],
    "choice": lambda seq: seq[0],
    "shuffle": lambda x: None,
    "sample": lambda population, k: list(population)[:k],
}
"""Python's ``random`` module's draws at their medians (the module docstring)."""


@contextlib.contextmanager
def host_medians() -> Iterator[None]:
    """Python's ``random`` and NumPy's global-generator functions replaced by their medians while
    entered (the module docstring); restored on exit."""
    modules = [(random, _PYTHON_MEDIANS)]
    if "numpy" in sys.modules:
        np = sys.modules["numpy"]
        modules.append((np.random, _numpy_medians(np)))
    saved = [(module, name, getattr(module, name)) for module, table in modules for name in table]
    try:
        for module, table in modules:
            for name, fixed in table.items():
                setattr(module, name, fixed)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
