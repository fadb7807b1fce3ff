"""Run a function on P local processes joined in one process group, without torchrun.

For tests and CPU benchmarks: ``spawn`` start method, a FileStore in a temporary directory
(no ports to pick, none to collide), a timeout on every join so a failing rank never hangs
the caller, and each rank's result or traceback returned to the caller.

    from moe.parallel.launch import run_local
    results = run_local(my_fn, 4)           # my_fn(rank, world) on 4 gloo processes
    values = ok_values(results)             # raises with every failed rank's traceback
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe.checks import positive_int


def _entry(rank: int, world: int, workdir: str, fn: Callable, args: tuple, pg_timeout_s: float, threads: int) -> None:
    torch.set_num_threads(threads)
    out = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(workdir, 'store')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001  (report every failure to the parent, exit non-zero)
        with open(out, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        os._exit(1)
    with open(out, "wb") as f:
        pickle.dump(("ok", result), f)
    dist.destroy_process_group()


def run_local(
    fn: Callable,
    world: int,
    *args,
    timeout_s: float = 150.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` (a module-level function: it is pickled by name) on
    ``world`` spawned gloo CPU processes with ``threads`` torch threads each. Returns per rank
    ``("ok", result)``, ``("error", traceback)`` or ``("missing", why)`` (the rank died
    without a word). ``pg_timeout_s`` bounds every collective; after ``timeout_s`` every
    process still running is killed and AssertionError raised."""
    positive_int("world", world)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [
            ctx.Process(target=_entry, args=(r, world, workdir, fn, args, pg_timeout_s, threads)) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(10)
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout_s}s (killed)")
        results = []
        for r in range(world):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(("missing", f"rank {r} wrote no result (exit code {procs[r].exitcode})"))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


def ok_values(results: list[tuple[str, Any]]) -> list[Any]:
    """The per-rank results of :func:`run_local`; AssertionError with every failure otherwise."""
    bad = [f"rank {r} {status}:\n{value}" for r, (status, value) in enumerate(results) if status != "ok"]
    if bad:
        raise AssertionError("\n".join(bad))
    return [value for _, value in results]
