"""A target's random draws fixed at their medians (or at another quantile of their laws), so its
routing rule can be audited without the noise that hides it.

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

``FixedDraws(quantile=q)`` puts each draw at the q-quantile of its law instead (the median is
q = 1/2): a uniform draw ``low + q (high - low)``, a Gaussian ``mean + std z_q``, integers the
q-quantile of their range, a Bernoulli 1 where p >= 1 - q, dropout's mask all kept where p <= q;
a permutation, a multinomial, a Poisson and a binomial sample stay as at the median. One
constant per law, whatever the shape of the draw, as the median is: a rule whose draws decide
a branch only away from their median (a second expert kept where ``2 p > U``, crowding a
capacity only when most are kept) shows that branch at a quartile. A sequence of quantiles puts
a call's draws at them in turn: two draws of one law fixed at one constant are tied, and a rule
that compares them (zoology's ``BigBIRDAttention`` keeps a random pair (i, j) of positions,
each drawn over [0, T - 1), only where i > j) then keeps nothing; one at its upper quartile and
the next at its lower one keeps the pair.

Python's ``random`` and NumPy's global generator pass no dispatch mode: :func:`host_medians`
replaces their common draws (the module functions, looked up when called) for as long as it is
entered, numbers by the middle of their range or their mean (their quantile ``q`` where given), an order by the identity (``shuffle``
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
import statistics
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


def _integer(low: int, high: int, q: float = 0.5) -> int:
    """The q-quantile of a uniform integer in [low, high) (its middle at q = 1/2)."""
    return low + max(math.ceil(q * (high - low)) - 1, 0)


def _random_quantile(args: tuple, kwargs: dict, q: float) -> int:
    """``random_(from, to)``: the q-quantile of [from, to); ``random_(to)``: of [0, to); 0 without a range."""
    low, high = (args[1], args[2]) if len(args) > 2 else (0, args[1]) if len(args) > 1 else (0, 1)
    low, high = kwargs.get("from", low), kwargs.get("to", high)
    return _integer(low, high, q) if high is not None else low


def _randint_quantile(name: str, args: tuple, kwargs: dict, q: float) -> int:
    """``randint(high, size)``, ``randint(low, high, size)`` and their ``_like`` forms: the
    q-quantile of [low, high)."""
    numbers = [a for a in (args[1:] if name == "randint_like" else args) if isinstance(a, int)]
    low, high = (0, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1])
    return _integer(kwargs.get("low", low), kwargs.get("high", high), q)


def _dropout(args: tuple, out: tuple, q: float) -> tuple:
    """``native_dropout(x, p, train)``: every element kept (x / (1 - p)) where p <= q (its keep
    mask, a Bernoulli of 1 - p, at its q-quantile), else none."""
    x, p = args[0], float(args[1])
    keep = p <= q
    out[1].fill_(keep)
    _fill(out[0], x / (1 - p) if keep else 0.0)
    return out


def _quantile(name: str, args: tuple, kwargs: dict, out: Any, q: float) -> Any:
    """``out`` (what the op ``name`` drew) overwritten with its law's q-quantile (the module
    docstring); None for an op not known."""
    if name == "native_dropout":
        return _dropout(args, out, q) if _arg(args, kwargs, 2, "train", True) else out
    first = args[0] if args else None
    z = statistics.NormalDist().inv_cdf(q)
    quantiles = {
        "uniform_": lambda: (
            _arg(args, kwargs, 1, "from", 0.0)
            + q * (_arg(args, kwargs, 2, "to", 1.0) - _arg(args, kwargs, 1, "from", 0.0))
        ),
        "normal_": lambda: _arg(args, kwargs, 1, "mean", 0.0) + z * _arg(args, kwargs, 2, "std", 1.0),
        "normal": lambda: (first if first is not None else kwargs["mean"]) + z * _arg(args, kwargs, 1, "std", 1.0),
        "exponential_": lambda: -math.log1p(-q) / _arg(args, kwargs, 1, "lambd", 1.0),
        "cauchy_": lambda: (
            _arg(args, kwargs, 1, "median", 0.0) + _arg(args, kwargs, 2, "sigma", 1.0) * math.tan(math.pi * (q - 0.5))
        ),
        "log_normal_": lambda: math.exp(_arg(args, kwargs, 1, "mean", 1.0) + z * _arg(args, kwargs, 2, "std", 2.0)),
        "geometric_": lambda: max(1, math.ceil(math.log1p(-q) / math.log1p(-_arg(args, kwargs, 1, "p", 0.5)))),
        "bernoulli_": lambda: torch.as_tensor(_arg(args, kwargs, 1, "p", 0.5)) >= 1 - q,
        "bernoulli": lambda: torch.as_tensor(_arg(args, kwargs, 1, "p", first)) >= 1 - q,
        "random_": lambda: _random_quantile(args, kwargs, q),
        "rand": lambda: q,
        "rand_like": lambda: q,
        "randn": lambda: z,
        "randn_like": lambda: z,
        "randint": lambda: _randint_quantile("randint", args, kwargs, q),
        "randint_like": lambda: _randint_quantile("randint_like", args, kwargs, q),
        "randperm": lambda: torch.arange(out.numel()),
        "poisson": lambda: torch.floor(first + 1 / 3),
        "binomial": lambda: torch.floor(first * _arg(args, kwargs, 1, "prob", 0.5)),
    }
    if name == "multinomial":
        return _multinomial(first, _arg(args, kwargs, 1, "num_samples", 1), out)
    if name not in quantiles:
        return None
    return _fill(out, quantiles[name]())


class FixedDraws(TorchDispatchMode):
    """Every seeded random op of torch run, then what it drew overwritten with its law's median, or
    its ``quantile`` (the module docstring); ops it does not know keep their draws and are named in
    :attr:`unknown`. ``quantile`` a sequence: the k-th draw of each call (each entry of the mode) at
    ``quantile[k % len(quantile)]``, so two draws of one law that a rule compares are not tied;
    draw k is then the same op in every call only if every call draws the same ops in the same
    order, which :attr:`misaligned` says where not."""

    def __init__(self, quantile: float | tuple[float, ...] = 0.5) -> None:
        super().__init__()
        self.quantiles = (quantile,) if isinstance(quantile, float) else tuple(quantile)
        self.unknown: set[str] = set()
        self.drawn: list[str] = []
        """The random ops of the current call, in order."""
        self.order: list[str] | None = None
        """Those of the first call that returned."""
        self.misaligned = False
        """Whether a call that returned drew other ops, or in another order, than the first."""

    def __enter__(self) -> FixedDraws:
        self.drawn = []
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        if exc_type is None:
            self.order = self.drawn if self.order is None else self.order
            self.misaligned = self.misaligned or self.drawn != self.order

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return out
        name = func._overloadpacket.__name__
        q = self.quantiles[len(self.drawn) % len(self.quantiles)]
        self.drawn.append(name)
        fixed = _quantile(name, args, kwargs, out, q)
        if fixed is None:
            self.unknown.add(name)
            return out
        return fixed


def _numpy_quantiles(np: Any, q: float) -> dict[str, Any]:
    """NumPy's global-generator draws at their q-quantiles (the module docstring)."""
    z = statistics.NormalDist().inv_cdf(q)

    def full(size: Any, value: Any) -> Any:
        return value if size is None else np.full(size, value)

    def randint(low: int, high: int | None = None, size: Any = None, dtype: Any = int) -> Any:
        value = _integer(0, low, q) if high is None else _integer(low, high, q)
        return np.dtype(dtype).type(value) if size is None else np.full(size, value, dtype=dtype)

    def choice(a: Any, size: Any = None, replace: bool = True, p: Any = None) -> Any:
        population = np.arange(a) if isinstance(a, int) else np.asarray(a)
        order = np.arange(len(population)) if p is None else np.argsort(-np.asarray(p), kind="stable")
        count = 1 if size is None else int(np.prod(size))
        picked = population[np.resize(order, count) if count > len(order) else order[:count]]
        return picked[0] if size is None else picked.reshape(size)

    return {
        "rand": lambda *dims: full(dims or None, q),
        "randn": lambda *dims: full(dims or None, z),
        "random": lambda size=None: full(size, q),
        "random_sample": lambda size=None: full(size, q),
        "uniform": lambda low=0.0, high=1.0, size=None: full(size, low + q * (high - low)),
        "normal": lambda loc=0.0, scale=1.0, size=None: full(size, loc + z * scale),
        "standard_normal": lambda size=None: full(size, z),
        "randint": randint,
        "permutation": lambda x: np.arange(x) if isinstance(x, int) else np.array(x),
        "shuffle": lambda x: None,
        "choice": choice,
    }


def _python_quantiles(q: float) -> dict[str, Any]:
    """Python's ``random`` module's draws at their q-quantiles (the module docstring)."""
    z = statistics.NormalDist().inv_cdf(q)
    return {
        "random": lambda: q,
        "uniform": lambda a, b: a + q * (b - a),
        "gauss": lambda mu=0.0, sigma=1.0: mu + z * sigma,
        "normalvariate": lambda mu=0.0, sigma=1.0: mu + z * sigma,
        "randint": lambda a, b: _integer(a, b + 1, q),
        "randrange": lambda start, stop=None, step=1: (
            r := range(0, start) if stop is None else range(start, stop, step)
        )[_integer(0, len(r), q)],
        "choice": lambda seq: seq[0],
        "shuffle": lambda x: None,
        "sample": lambda population, k: list(population)[:k],
    }


@contextlib.contextmanager
def host_medians(quantile: float = 0.5) -> Iterator[None]:
    """Python's ``random`` and NumPy's global-generator functions replaced by their medians (their
    ``quantile``) while entered (the module docstring); restored on exit."""
    modules = [(random, _python_quantiles(quantile))]
    if "numpy" in sys.modules:
        np = sys.modules["numpy"]
        modules.append((np.random, _numpy_quantiles(np, quantile)))
    saved = [(module, name, getattr(module, name)) for module, table in modules for name in table]
    try:
        for module, table in modules:
            for name, fixed in table.items():
                setattr(module, name, fixed)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
