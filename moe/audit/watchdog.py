"""The parent process that stops ``moe-audit`` when a forward of its target never returns from
native code.

The per-forward time limit (:func:`moe.audit.runner.time_limit`) is a ``SIGALRM`` timer: it
interrupts Python code at once, but a native call that never returns to Python is never told
(fairseq's BASE layer, ``libbase.balanced_assignment``, loops forever when the number of experts
does not divide the token count, holding the GIL, so no thread of the process runs either). So
the command forks before it audits: the child audits and writes to a pipe when each limited
forward starts (its limit and what it is) and ends; the parent runs no target code and waits. A
forward still running at twice its limit ends the child (``SIGKILL``) and the command: one line
on stderr, exit 2, and below it what the audit of that target had found by then (each probe that saw
a change writes it to the pipe as it ends): a leak found before the stop is the verdict, exit 1.
Otherwise the parent exits with the child's code (a SIGTERM or SIGHUP it
receives is passed on to the child, so no audit is left running alone). Callers in the process
(``moe.audit.audit``, ``assert_causal``, ``cli.main``) have the ``SIGALRM`` limit only.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable

GRACE = 1.0
"""A forward is stopped at (1 + GRACE) x its limit: the limit for Python code to be interrupted
(or a long native op to return and be), as long again for the process to be ended."""

_channel: int | None = None
"""In the child: the pipe's write end (None: not supervised)."""


def started(limit: float, what: str) -> None:
    """Tell the parent a forward limited to ``limit`` seconds starts (``what``: the line's subject)."""
    if _channel is not None:
        os.write(_channel, f"{limit!r} {' '.join(what.split())}\n".encode())


def ended() -> None:
    """Tell the parent the forward returned (or raised)."""
    if _channel is not None:
        os.write(_channel, b"-\n")


def found(target: str, kind: str, mode: str, probe: str) -> None:
    """Tell the parent that ``probe`` (of ``kind``, :data:`moe.audit.report.KINDS`) saw a change of
    ``target``'s outputs in ``mode``: what it reports if it must stop the audit of that target."""
    if _channel is not None:
        os.write(_channel, f"! {kind} {mode} {probe} {' '.join(target.split())}\n".encode())


FOUND = {
    "future": "LEAKS in {mode} mode",
    "batch": "not batch-invariant in {mode} mode",
    "decode": "not decode-consistent in {mode} mode",
}
"""How the stop line names what probes of a kind found in a mode (the probes follow in brackets)."""


def supervised(run: Callable[[], int]) -> int:
    """``run()``'s exit code, run in a forked child that the parent stops when a forward outlives
    its limit in native code (the module docstring); ``run()`` itself where there is no fork."""
    if not hasattr(os, "fork"):
        return run()
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os._exit(_child(run, write))
    os.close(write)
    return _watch(pid, read)


def _child(run: Callable[[], int], write: int) -> int:
    """The exit code the interpreter would give ``run()`` (``os._exit`` skips its handling)."""
    global _channel
    _channel = write
    try:
        code = run()
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if code is None else int(code)


def _watch(pid: int, read: int) -> int:
    """Wait for the child, reading its forwards' starts and ends; stop it at a forward's deadline."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child too: its exit code is ours
    # `timeout`, a closed terminal: passed on to the audit, never an orphan left running
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, lambda signum, _frame: os.kill(pid, signum))
    deadline: float | None = None
    limit, what, pending = 0.0, "", b""
    findings: dict[str, dict[tuple[str, str], list[str]]] = {}  # target -> (kind, mode) -> probes
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if select.select([read], [], [], wait)[0]:
            chunk = os.read(read, 65536)
            if not chunk:  # the child exited
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == b"-":
                    deadline = None
                elif line.startswith(b"! "):
                    kind, mode, probe, target = line.decode()[2:].split(" ", 3)
                    findings.setdefault(target, {}).setdefault((kind, mode), []).append(probe)
                else:
                    text, what = line.decode().split(" ", 1)
                    limit = float(text)
                    deadline = time.monotonic() + (1 + GRACE) * limit
        elif deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return _stopped(what, limit, findings)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # a signal's number as a shell reports it


def _stopped(what: str, limit: float, findings: dict[str, dict[tuple[str, str], list[str]]]) -> int:
    """Print why the audit was stopped and what it had found of the stuck target; the exit code:
    1 where a probe had found a leak (a verdict the rest of the audit could not undo), else 2."""
    target = next((t for t in findings if what.startswith(f"{t}: ")), None)
    seen = findings.get(target, {})
    leaks = any(kind == "future" for kind, _ in seen)
    if leaks:  # audited enough for a verdict: not "NOT AUDITED"
        what = what.replace(f"{target}: NOT AUDITED: ", f"{target}: ", 1)
    print(
        f"moe-audit: error: {what} did not return within {limit:g} s (--forward-timeout), nor in the "
        f"{GRACE * limit:g} s after: native code the time limit cannot interrupt; moe-audit stopped",
        file=sys.stderr,
    )
    if seen:
        order = sorted(seen.items(), key=lambda item: list(FOUND).index(item[0][0]))  # leaks first
        done = "; ".join(f"{FOUND[kind].format(mode=mode)} ({', '.join(p)})" for (kind, mode), p in order)
        rest = "the rest not audited" if leaks else "no leak found yet, the rest not audited"
        print(f"moe-audit: {target}: found before the stop: {done}; {rest}", file=sys.stderr)
    return 1 if leaks else 2
