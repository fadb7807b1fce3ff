"""The studies' one row runner: a study is a list of rows, each one run of the library (one
``train()`` and its evaluation), cached in the study's results JSON under a key, so that the same
command resumes after a crash and a later command adds rows without rerunning stored ones.

* ``config_key``: the key of a row from what determines it (a hash of its config, as JSON with
  sorted keys); a study whose rows predate it keeps its own key function (leakage_gap.py: corpus
  and router; packet_loss.py: batch, workers, loss rate, policy, seed), since a stored row's key
  never changes;
* ``pending`` and ``merge``: the rows still to run, and stored rows with fresh ones in;
* ``run_rows``: the rows in spawned worker processes (nothing of the parent's state; a job sets
  its own torch threads), or in this process with ``workers=0``, each handed back as it finishes
  so the study stores it at once;
* ``provenance``: what ran a row (``commit``, ``machine``, ``command``, ``date``).

    from experiments.rows import config_key, pending, run_rows
    todo = pending(specs, result["rows"], key=lambda r: r["key"])
    run_rows(train_one, todo, workers=2, store=lambda row: (result["rows"].append(row), write(result)))
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


def config_key(what: dict) -> str:
    """16 hex digits of the SHA-1 of ``what`` as JSON with sorted keys: equal configs, equal keys."""
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def pending(specs: Iterable[dict], stored: Iterable[dict], key: Callable[[dict], Hashable]) -> list[dict]:
    """The specs whose key no stored row has, in their order."""
    done = {key(r) for r in stored}
    return [s for s in specs if key(s) not in done]


def merge(*groups: Iterable[dict], key: Callable[[dict], Hashable]) -> list[dict]:
    """One row per key over the groups in order: a key keeps the place of its first row and takes
    its last (a rerun replaces the stored row)."""
    keyed: dict = {}
    for group in groups:
        for row in group:
            keyed[key(row)] = row
    return list(keyed.values())


def run_rows(
    job: Callable[[dict], dict],
    specs: list[dict],
    workers: int,
    store: Callable[[dict], None],
    desc: str = "rows",
) -> None:
    """``job(spec)`` for every spec, ``store(row)`` for each result as it finishes: in ``workers``
    spawned processes (``job`` a module-level function), or in this process, in order, with
    ``workers=0``. A job's exception reaches the caller (after the
    running jobs finish)."""
    if workers == 0:
        for spec in specs:
            store(job(spec))
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(job, spec) for spec in specs]
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, file=sys.stderr):
            store(fut.result())


def commit() -> str:
    """This checkout's short commit hash ('' outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def machine() -> dict:
    """What a row ran on: its training is bit-exact across commits on one CPU type, not across CPU
    types (another instruction set rounds differently, and the run lands like another seed)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {
        "cpu": names[0] if names else platform.processor(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def command(script: str, argv: list[str]) -> str:
    """The command line that reruns ``script`` with ``argv``, quoted for a shell."""
    return shlex.join(["python", script, *argv])


def provenance(cmd: str) -> dict:
    """Where and when a row ran: the checkout's commit, the machine, the command and the date."""
    return {"commit": commit(), "machine": machine(), "command": cmd, "date": date.today().isoformat()}
