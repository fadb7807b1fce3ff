"""The one place the audit calls its target. Before every forward: a fresh contiguous copy of
the input, every buffer of the target (and every parameter a forward was seen to change) back
to its value at the start of the audit, and the random generators (torch's CPU and CUDA ones,
those the target keeps as attributes, Python's ``random`` and NumPy's global one when NumPy is
loaded) seeded; the random draws it makes recorded when asked; a time limit per forward; what
it prints sent to stderr; its exceptions turned into :class:`TargetFailure` naming the input
shape and where it raised.

Shape legend: B batch, T sequence, F output features per position.

The time limit is a ``SIGALRM`` timer, so it holds only on POSIX and in the main thread (elsewhere
forwards are not limited); it interrupts Python code (a loop that never ends) at once, a single
long-running native op (one huge matmul) only when it returns to Python. Under ``moe-audit`` a
forward that has not returned at twice its limit ends the command (:mod:`moe.audit.watchdog`).
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from moe.audit import watchdog
from moe.audit.fixed_draws import FixedDraws, host_medians
from moe.audit.target import AuditTarget, AuditUsageError, Outputs, raise_site

Draws = tuple[tuple[str, tuple[int, ...]], ...]
"""The random draws of one forward, in order: (aten op, shape of what it drew)."""


ERROR_CHARS = 300
"""How much of a target's own error message a report line keeps (:func:`one_line`)."""


_ERROR_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception): \S")
"""A line that names an error and says what it is (``RuntimeError: selected index k out of range``)."""


def one_line(text: str, limit: int = ERROR_CHARS) -> str:
    """``text`` on one line (each run of whitespace one space: a tensor printed in an error
    message spans many), cut to ``limit`` characters with an ellipsis. A text of several lines
    whose last line names an error (a TorchScript traceback ends with the error it reports) leads
    with that line, so the cut keeps what went wrong."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and _ERROR_LINE.match(lines[-1]):
        text = f"{lines[-1]}; {' '.join(lines[:-1])}"
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


class TargetFailure(Exception):
    """The target raised (or returned something unreadable) on one input shape. The message is
    one line: the error's own text through :func:`one_line`."""

    def __init__(self, shape: tuple[int, ...], error: BaseException) -> None:
        self.shape, self.error, self.where = shape, error, raise_site(error)
        text = one_line(str(error))
        # the target ran and returned what cannot be audited: no site to show (it would be the audit's own)
        self.what = (
            text if isinstance(error, AuditUsageError) else f"{type(error).__name__}: {text} (raised at {self.where})"
        )
        """What went wrong, without the shape."""
        super().__init__(f"input of shape {shape}: {self.what}")


class TargetTimeout(Exception):
    """A forward did not return within the per-forward time limit: the audit of this target stops."""

    def __init__(self, shape: tuple[int, ...], limit: float) -> None:
        self.shape, self.limit = shape, limit
        super().__init__(f"a forward on an input of shape {shape} did not return within {limit:g} s")


def exit_text(e: SystemExit) -> str:
    """``sys.exit(3)``, ``sys.exit()``: the call a target made, from the SystemExit it raised."""
    return f"sys.exit({'' if e.code is None else repr(e.code)})"


class TargetExit(Exception):
    """The target called ``sys.exit`` in a forward: the audit of this target stops (NOT AUDITED)."""

    def __init__(self, shape: tuple[int, ...], error: SystemExit) -> None:
        self.shape = shape
        super().__init__(
            f"the target could not be run: it called {exit_text(error)} in a forward on an input of shape {shape}"
        )


class _Expired(BaseException):
    """Raised inside the target by the timer (a BaseException: a target's ``except Exception``
    does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str = "a forward") -> Iterator[None]:
    """Raise :class:`_Expired` in the main thread when the block runs past ``seconds`` (None, 0,
    another thread or no ``setitimer``: no limit). A timer already set outside is resumed after.
    Under ``moe-audit``'s watchdog the block (``what``, for its error line) is also stopped with
    the command when it outlives the limit in native code (:mod:`moe.audit.watchdog`)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    watchdog.started(seconds, what)
    try:
        yield
    finally:
        watchdog.ended()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


class _DrawRecorder(TorchDispatchMode):
    """Records every seeded random op (``nondeterministic_seeded`` tag) and the shape it drew."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.draws.append((str(func), tuple(first.shape) if isinstance(first, Tensor) else ()))
        return out


@functools.cache
def _warm_up_draw_recording() -> None:
    """The first dispatch mode of a process imports what torch needs for it (torch._dynamo and
    sympy: about a second of CPU): done once, before the first recorded forward and outside its
    clock and time limit, so the limit never interrupts an import half-way; a process that audits
    only targets drawing no random numbers never pays it."""
    with _DrawRecorder():
        torch.ones(1) + 1


def cost_clock(x: Tensor) -> Callable[[], float]:
    """The clock the audit's cost is read on: this process's CPU time for a CPU input under one
    torch thread (a machine shared with other jobs stretches wall time by several times, at
    random); wall time otherwise (other devices run asynchronously, and idle torch threads that
    spin burn CPU time that is no work)."""
    return time.process_time if x.device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


@dataclass
class Cost:
    """What the calls of the target cost so far."""

    forwards: int = 0
    """Calls of the target (forwards, with or without gradients)."""
    samples: int = 0
    """Samples run, summed over calls (a packed forward of P copies of B samples counts P * B)."""
    seconds: float = 0.0
    """Time inside the target's forwards (as :attr:`Runner.last_seconds` measures it)."""


@dataclass
class Forward:
    """One call of the target."""

    out: Outputs
    draws: Draws | None
    """Its random draws, when the call asked for them (None: not recorded); draws from Python's
    or NumPy's generator are one last entry, where they left those generators."""


class Runner:
    """Calls the target: the same ``seed`` before every forward unless another is given, so two
    forwards of the same shape see the same noise where the target draws it per position.
    ``timeout``: seconds one forward may take (None: no limit); past it, :class:`TargetTimeout`.
    ``name``: the audit's name for the target (the watchdog's error line)."""

    def __init__(self, target: AuditTarget, seed: int, timeout: float | None = None, name: str = "") -> None:
        self.target, self.seed, self.timeout, self.name = target, seed, timeout, name
        self.cost = Cost()
        self.last_seconds = 0.0
        """How long the last call took, on :func:`cost_clock`."""
        self.last_drew = False
        """Whether the last call advanced a generator the runner seeds (torch's CPU and CUDA ones,
        the target's own, Python's, NumPy's): it drew random numbers."""
        self.last_host_draws: tuple[int, ...] | None = None
        """Where the last call left Python's and NumPy's generators, if it drew from them (None:
        it did not); the same seed and the same number of draws leave them at the same place."""
        self.fixed_draws: FixedDraws | None = None
        """While set (:meth:`drawing_fixed`): the mode every call runs in, its random draws fixed."""

    @contextlib.contextmanager
    def drawing_fixed(self, quantile: float | tuple[float, ...] = 0.5) -> Iterator[FixedDraws]:
        """Calls within run with every random draw of torch, and the common draws of Python's and
        NumPy's generators, fixed at their medians, or at the ``quantile`` of their laws (a
        sequence: torch's draws of a call at its quantiles in turn, Python's and NumPy's at their
        medians; :mod:`moe.audit.fixed_draws`); the mode yielded names the torch ops it could not
        fix and whether every call drew the same ones."""
        _warm_up_draw_recording()
        self.fixed_draws = FixedDraws(quantile)
        try:
            with host_medians(quantile if isinstance(quantile, float) else 0.5):
                yield self.fixed_draws
        finally:
            self.fixed_draws = None

    def _reset(self, seed: int) -> None:
        """The target's buffers (and the parameters a forward changed) as at the start; every generator it may draw from seeded: the CPU
        one, every CUDA one once CUDA is in use (seeding it before would queue a seed for whoever
        initialises CUDA later), its own, Python's and NumPy's."""
        self.target.state.reset()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
        for g in self.target.state.generators:
            g.manual_seed(seed)
        random.seed(seed)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(seed % 2**32)

    def _generator_states(self) -> list[Tensor]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return [torch.default_generator.get_state(), *cuda, *(g.get_state() for g in self.target.state.generators)]

    @staticmethod
    def _host_states() -> tuple[int, ...]:
        """Python's generator state and NumPy's key and position, as numbers (a draw moves them)."""
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return (hash(random.getstate()),)
        _, key, pos, *_ = numpy.random.get_state()
        return hash(random.getstate()), hash(key.tobytes()), int(pos)

    def _run(self, x: Tensor, seed: int, call: Any) -> Any:
        """``call(fresh copy of x)`` after :meth:`_reset`, within the time limit; sets
        :attr:`last_drew`."""
        fresh = x.detach().clone(memory_format=torch.contiguous_format)
        self._reset(seed)
        seeded, host = self._generator_states(), self._host_states()
        clock = cost_clock(x)
        start = clock()
        try:
            what = f"{self.name}: NOT AUDITED: " if self.name else ""
            # what the target prints goes to stderr: stdout is the report's (a JSON or a table a script reads)
            with (
                contextlib.redirect_stdout(sys.stderr),
                time_limit(self.timeout, f"{what}a forward on an input of shape {tuple(x.shape)}"),
                self.fixed_draws or contextlib.nullcontext(),
            ):
                out = call(fresh)
                if x.device.type == "cuda":  # the kernels ran when the clock stops, not just their launch
                    torch.cuda.synchronize(x.device)
                return out
        except _Expired:
            raise TargetTimeout(tuple(x.shape), self.timeout) from None
        except SystemExit as e:  # never the audit's own exit: its caller reads it as a verdict
            raise TargetExit(tuple(x.shape), e) from None
        except Exception as e:  # the target's own failure: reported with the shape, never raised
            raise TargetFailure(tuple(x.shape), e) from None
        finally:
            self.last_seconds = clock() - start
            after = self._host_states()
            self.last_host_draws = after if after != host else None
            torch_drew = any(not torch.equal(a, b) for a, b in zip(seeded, self._generator_states()))
            # with torch's draws fixed, a target draws through the ops that could not be fixed and
            # Python's and NumPy's generators, which no dispatch mode sees
            fixed = self.fixed_draws
            torch_drew = torch_drew and (fixed is None or bool(fixed.unknown))
            self.last_drew = self.last_host_draws is not None or torch_drew
            self.cost.forwards += 1
            self.cost.samples += x.shape[0]
            self.cost.seconds += self.last_seconds

    def forward(self, x: Tensor, seed: int | None = None, record: bool = False) -> Forward:
        """One call of the target on a fresh copy of x; ``record``: also list its random draws
        (a dispatch mode around the call: slower, so only where the draws are compared)."""
        if record:
            _warm_up_draw_recording()
        recorder = _DrawRecorder() if record else None

        def call(fresh: Tensor) -> Outputs:
            if recorder is None:
                return self.target(fresh)
            with recorder:
                return self.target(fresh)

        out = self._run(x, self.seed if seed is None else seed, call)
        if recorder is None:
            return Forward(out, None)
        # Python's and NumPy's draws pass no dispatch mode: where the generators were left stands for them
        host = () if self.last_host_draws is None else (("python/numpy generators", self.last_host_draws),)
        return Forward(out, tuple(recorder.draws) + host)

    def time_forward(self, x: Tensor) -> float:
        """One plain eval forward of the target on x (:meth:`AuditTarget.plain`), its time on
        :func:`cost_clock`."""
        self.plain(x)
        return self.last_seconds

    def plain(self, x: Tensor) -> Any:
        """The target's output for x as it returns it, from a plain forward (:meth:`AuditTarget.plain`):
        nothing read, so its shapes can be checked."""
        return self._run(x, self.seed, self.target.plain)

    def forward_with_grad(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """(value_BTF with its graph, the input it is differentiated against) or None; see
        :meth:`AuditTarget.forward_with_grad`. Always under the audit seed."""
        return self._run(x, self.seed, self.target.forward_with_grad)
