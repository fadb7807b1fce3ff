"""Audit the zoo: one row per block (or whole causal LM), as a table and as JSON.

Shape legend: B batch, T sequence, D hidden size.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from moe.audit import AuditReport, AuditUsageError, audit
from moe.audit.report import yes_no
from moe.audit.zoo.build import (
    VOCAB,
    Built,
    ZooEntry,
    build,
    discover,
    example_for,
    hidden_output,
    reason,
    transformers_module,
)
from moe.audit.zoo.frameworks import FRAMEWORKS, FrameworkConfig, unavailable

MODES = ("train", "eval")
"""Both training-flag settings, each audited (the audit's public API takes them by name)."""


@dataclass
class ZooRow:
    """One audited zoo entry: what its code says, the audit's report, or why it could not run."""

    entry: ZooEntry
    library: str
    library_version: str
    built: Built | None = None
    """None when the entry could not be built."""
    report: AuditReport | None = None
    error: str | None = None
    """Why it could not be built or audited: then ``report`` is None, or holds the audit's own
    error (a target it could not judge) and its verdicts mean nothing."""
    dropped: dict[str, float] = field(default_factory=dict)
    """Per mode: fraction of the example's tokens whose output row is exactly zero, i.e. served
    by no expert (float inputs only; a lower bound on dropping with shared experts or top-k > 1)."""
    seconds: float = 0.0

    @property
    def regime(self) -> str | None:
        """The audit regime the report names; reports from before regimes existed were fixed-seed."""
        return None if self.report is None else getattr(self.report, "regime", None) or "fixed seed"

    def to_dict(self) -> dict:
        e, r, b = self.entry, self.report, self.built
        base = r.to_dict() if r is not None else {"name": e.name}
        if self.error is not None:
            base.update(leaks=None, leaks_in=None)
        return {
            **base,
            "library": self.library,
            "library_version": self.library_version,
            "class": e.cls_name,
            "family": e.family,
            "kind": e.kind,
            "router_kind": None if b is None else b.router_kind,
            "capacity": None if b is None else b.capacity,
            "train_noise": None if b is None else b.train_noise,
            "dropped": self.dropped,
            "regime": self.regime,
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


def audit_entry(entry: ZooEntry, modes: tuple[str, ...] = MODES, trials: int = 2, seed: int = 0) -> ZooRow:
    """Build and audit one entry; any exception from building or running it becomes the row's error."""
    row = ZooRow(entry, "transformers", transformers_module().__version__)
    start = time.perf_counter()
    try:
        _audit_built(row, build(entry), example_for(entry, seed), modes, trials, seed)
    except Exception as e:  # the row says why this entry could not be audited
        row.report, row.error = None, reason(e)
    row.seconds = time.perf_counter() - start
    return row


def audit_framework(fc: FrameworkConfig, modes: tuple[str, ...] = MODES, trials: int = 2, seed: int = 0) -> ZooRow:
    """Audit one training-framework router configuration (a row saying why when the framework
    is not installed or cannot be imported)."""
    entry = ZooEntry(fc.library, fc.name, "router", fc.module)
    why = unavailable(fc.library)
    row = ZooRow(entry, fc.library, "not available" if why else importlib.metadata.version(fc.library))
    if why:
        row.error = why
        return row
    start = time.perf_counter()
    built = Built(fc.make, fc.router_kind, fc.capacity, fc.train_noise, fc.note)
    try:
        _audit_built(row, built, example_for(entry, seed), modes, trials, seed)
    except Exception as e:  # the row says why this configuration could not be audited
        row.report, row.error = None, reason(e)
    row.seconds = time.perf_counter() - start
    return row


def _audit_built(row: ZooRow, built: Built, x: Tensor, modes: tuple[str, ...], trials: int, seed: int) -> None:
    row.built = built
    # A fresh target for the audit: some blocks keep per-call state in plain attributes
    # (NLLB-MoE's router overwrites expert_capacity in eval), which no state_dict restores.
    row.dropped = _dropped(built.make(), x, modes)
    vocab = VOCAB if row.entry.kind == "causal LM" else None
    row.report = audit(built.make(), x, modes=modes, trials=trials, seed=seed, name=row.entry.name, vocab_size=vocab)
    row.error = row.report.error  # the audit ran but could not judge the target


def _dropped(target: nn.Module, x: Tensor, modes: tuple[str, ...]) -> dict[str, float]:
    if not x.is_floating_point():
        return {}
    out = {}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for mode in modes:
            target.train(mode == "train")
            y_BTD = hidden_output(target(x))
            out[mode] = float((y_BTD == 0).all(-1).float().mean())
    return out


def audit_zoo(
    modes: tuple[str, ...] = MODES,
    trials: int = 2,
    seed: int = 0,
    families: Iterable[str] | None = None,
    progress: bool = False,
) -> list[ZooRow]:
    """Discover the zoo (only ``families`` when given) and audit every entry; ``progress``: a
    tqdm bar on stderr."""
    entries = discover(families)
    return _each(entries, "block", progress, lambda e: (e.cls_name, audit_entry(e, modes, trials, seed)))


def audit_frameworks(
    modes: tuple[str, ...] = MODES,
    trials: int = 2,
    seed: int = 0,
    libraries: Iterable[str] | None = None,
    progress: bool = False,
) -> list[ZooRow]:
    """Audit every training-framework configuration (:data:`~moe.audit.zoo.frameworks.FRAMEWORKS`;
    only those of ``libraries`` when given); a framework that is not installed gets rows saying so."""
    keep = None if libraries is None else set(libraries)
    configs = [fc for fc in FRAMEWORKS if keep is None or fc.library in keep]
    return _each(configs, "router", progress, lambda fc: (fc.library, audit_framework(fc, modes, trials, seed)))


def _each(items: list, unit: str, progress: bool, audit_one: Callable[[Any], tuple[str, ZooRow]]) -> list[ZooRow]:
    """audit_one(item) -> (progress label, row) for every item, under a tqdm bar on stderr."""
    bar = tqdm(items, desc="moe-audit --zoo", unit=unit, file=sys.stderr, disable=not progress, leave=False)
    rows = []
    for item in bar:
        label, row = audit_one(item)
        bar.set_postfix_str(label)
        rows.append(row)
    bar.close()
    return rows


def zoo_json(rows: list[ZooRow]) -> str:
    """``{"targets": [...]}``: the audit's schema, one entry per row, with the zoo's keys added."""
    return json.dumps({"targets": [r.to_dict() for r in rows]}, indent=2)


ZOO_COLUMNS = (
    "library",
    "class",
    "kind",
    "router kind (from its code)",
    "capacity",
    "random in train",
    "dropped (train/eval)",
    "leaks in",
    "batch-invariant",
    "decode-consistent",
    "regime",
    "time",
)


def zoo_markdown(rows: list[ZooRow]) -> str:
    """The zoo as a Markdown table, one line per row."""
    lines = ["| " + " | ".join(ZOO_COLUMNS) + " |", "|" + "---|" * len(ZOO_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    return "\n".join(lines)


def _cells(r: ZooRow) -> list[str]:
    e, b, rep = r.entry, r.built, r.report
    head = [f"{r.library} {r.library_version}", f"`{e.cls_name}`", e.kind]
    kind = None if b is None else b.router_kind + (f" (audited: {b.note})" if b.note else "")
    head += ["-", "-", "-"] if b is None else [kind, b.capacity or "-", b.train_noise or "-"]
    if rep is None or r.error is not None:
        return head + ["-", f"not run: {r.error}", "-", "-", r.regime or "-", f"{r.seconds:.1f}s"]
    dropped = "/".join(f"{r.dropped[m]:.0%}" for m in rep.modes if m in r.dropped) or "-"
    decode = (
        "**no** (" + ", ".join(rep.decode_differs_in) + ")"
        if rep.decode_consistent is False
        else yes_no(rep.decode_consistent)
    )
    return head + [
        dropped,
        "**" + ", ".join(rep.leaks_in) + "**" if rep.leaks else "none",
        "**no**" if rep.batch_invariant is False else yes_no(rep.batch_invariant),
        decode,
        r.regime or "-",
        f"{r.seconds:.1f}s",
    ]


def run_zoo(modes: tuple[str, ...], trials: int, seed: int, json_path: str | None, progress: bool) -> int:
    """``moe-audit --zoo``: audit the transformers blocks (when transformers is installed) and
    every training-framework router, print the table and a summary, write ``json_path``. Exit
    code 0 (the zoo reports on other libraries; their leaks are findings, not failures of this
    run), 2 when the JSON cannot be written."""
    start = time.perf_counter()
    try:
        rows = audit_zoo(modes, trials, seed, progress=progress)
    except AuditUsageError as e:  # no transformers: the frameworks still run
        print(f"moe-audit: {e}; auditing the training frameworks only", file=sys.stderr)
        rows = []
    rows += audit_frameworks(modes, trials, seed, progress=progress)
    print(zoo_markdown(rows))
    ran = [r for r in rows if r.report is not None and r.error is None]
    leaky = [r.entry.name for r in ran if r.report.leaks]
    mixing = [r.entry.name for r in ran if r.report.batch_invariant is False]
    print(
        f"\n{len(rows)} zoo entries ({len(ran)} audited, {len(rows) - len(ran)} could not run) in "
        f"{time.perf_counter() - start:.0f} s; leak: {', '.join(leaky) or 'none'}; "
        f"not batch-invariant: {', '.join(mixing) or 'none'}"
    )
    if json_path:
        try:
            Path(json_path).write_text(zoo_json(rows) + "\n")
        except OSError as e:
            raise AuditUsageError(f"cannot write --json {json_path}: {e}") from None
    return 0
