"""``moe-audit``: check that routers, MoE layers and models keep their causality claims.

    moe-audit                                     # every built-in router, as router / layer / tiny model
    moe-audit --target mypkg.models:build --input tokens:4,32,256
    moe-audit --target path/to/file.py:layer --input float:4,16,64 --json audit.json
    python -m moe.audit --modes eval --trials 4 --seed 1

Exit codes: 0 every claim holds (``--target``: no leak in any mode); 1 a target that claims
to be causal leaks, or claims batch invariance it lacks (``--target``: it leaks in some mode);
2 usage error (unimportable target, a name that is neither a module nor a factory, a
malformed --input, an output that is not [B, T, ...]).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn
from tqdm import tqdm

from moe.audit.probes import MODES, audit
from moe.audit.report import AuditReport, reports_to_json, summary_table
from moe.audit.suite import builtin_targets
from moe.audit.target import AuditTarget, AuditUsageError
from moe.layer import MoELayer
from moe.routing import Router

DEFAULT_BATCH, DEFAULT_SEQ = 4, 16
"""B and T of the input when --input is left out and the target says its width / vocabulary."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-audit",
        description="Causality audit: does the output at position t ignore inputs at positions > t? "
        "Without --target, audits every built-in router (alone, in an MoELayer, in the tiny model) "
        "against its claims.",
        epilog="Exit codes: 0 all claims hold / no leak; 1 a false causal, batch-invariance or decode-consistency claim "
        "(with --target: a leak in some mode); 2 usage error.",
    )
    p.add_argument(
        "--target",
        metavar="MODULE:NAME",
        help="pkg.module:name or path/to/file.py:name; name is an nn.Module or a zero-argument callable returning one",
    )
    p.add_argument(
        "--input",
        metavar="SPEC",
        help="float:B,T,D[,...] (normal features) or tokens:B,T,V (ids below V); "
        "optional for routers, MoE layers and models with an nn.Embedding",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to audit (default: train,eval)")
    p.add_argument("--trials", type=int, default=2, help="random perturbations per cut position (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed for inputs, perturbations and built-in targets (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the reports as JSON to PATH")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for the built-in suite, whose tensors are tiny; torch's default for --target)",
    )
    p.add_argument(
        "--zoo",
        action="store_true",
        help="audit every sparse MoE block of the installed Hugging Face transformers (needs the [zoo] extra)",
    )
    p.add_argument("--verbose", action="store_true", help="print the per-probe table of every target")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        modes = _parse_modes(args.modes)
        if args.trials < 1:
            raise AuditUsageError(f"--trials must be >= 1, got {args.trials}")
        if args.threads is not None and args.threads < 1:
            raise AuditUsageError(f"--threads must be >= 1, got {args.threads}")
        threads = args.threads if args.threads is not None else (None if args.target else 1)
        if threads is not None:
            torch.set_num_threads(threads)
        if args.zoo:
            if args.target or args.input:
                raise AuditUsageError("--zoo builds its own targets and inputs; drop --target / --input")
            from moe.audit.zoo import run_zoo

            return run_zoo(modes, args.trials, args.seed, args.json, progress=not args.no_progress)
        start = time.perf_counter()
        if args.target:
            reports = [_audit_user_target(args, modes)]
            failed = reports[0].leaks
        else:
            if args.input:
                raise AuditUsageError("--input only applies to --target (the built-in suite chooses its own inputs)")
            reports = _audit_builtins(args, modes)
            failed = any(r.violations for r in reports)
    except AuditUsageError as e:
        print(f"moe-audit: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    _print(reports, args, elapsed)
    if args.json:
        try:
            Path(args.json).write_text(reports_to_json(reports) + "\n")
        except OSError as e:
            print(f"moe-audit: error: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 2
    return 1 if failed else 0


def _print(reports: list[AuditReport], args: argparse.Namespace, elapsed: float) -> None:
    if args.verbose or args.target:
        for r in reports:
            print(r.table(), end="\n\n")
    print(summary_table(reports))
    if args.target:
        r = reports[0]
        verdict = f"LEAKS in {', '.join(r.leaks_in)} mode" if r.leaks else "no leak found"
        print(f"\n{r.name}: {verdict}; batch-invariant: {'yes' if r.batch_invariant else 'no'}; {elapsed:.1f} s")
        return
    bad = [r for r in reports if r.violations]
    print(f"\n{len(reports)} targets audited in {elapsed:.1f} s (modes: {args.modes}, trials: {args.trials}, seed: {args.seed})")
    if bad:
        print(f"FALSE CLAIMS in {len(bad)} target(s):")
        for r in bad:
            print(f"  {r.name}: {'; '.join(r.violations)}")
    else:
        print("every claim holds")
    unshown = [r for r in reports if r.unshown]
    for r in unshown:
        print(f"  note: {r.name}: {'; '.join(r.unshown)}")


def _parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise AuditUsageError(f"--modes takes a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return modes


def _audit_builtins(args: argparse.Namespace, modes: tuple[str, ...]) -> list[AuditReport]:
    reports = []
    targets = builtin_targets(seed=args.seed)
    bar = tqdm(targets, desc="moe-audit", unit="target", file=sys.stderr, disable=args.no_progress, leave=False)
    for bt in bar:
        bar.set_postfix_str(bt.name)
        reports.append(audit(bt.build(), bt.example(), modes=modes, trials=args.trials, seed=args.seed, name=bt.name))
    bar.close()
    return reports


def _audit_user_target(args: argparse.Namespace, modes: tuple[str, ...]) -> AuditReport:
    module, name = load_target(args.target)
    example, vocab = (
        parse_input(args.input, args.seed) if args.input else _default_input(module, args.seed, args.target)
    )
    try:
        with torch.no_grad(), AuditTarget(module).preserved():
            module(example)
    except Exception as e:  # any failure of the user's forward is a usage problem here
        shape = f"{'tokens' if vocab else 'float'} of shape {tuple(example.shape)}"
        raise AuditUsageError(
            f"the target {name} failed on an input of {shape}: {type(e).__name__}: {e}; fix --input"
        ) from None
    return audit(module, example, modes=modes, trials=args.trials, seed=args.seed, name=name, vocab_size=vocab)


def load_target(spec: str) -> tuple[nn.Module, str]:
    """Import ``pkg.module:name`` or ``path/to/file.py:name`` and return (module, display name)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise AuditUsageError(f"--target must be pkg.module:name or path/to/file.py:name, got {spec!r}")
    source = _import_file(where) if where.endswith(".py") or os.sep in where or "/" in where else _import_module(where)
    if not hasattr(source, attr):
        public = sorted(n for n in vars(source) if not n.startswith("_"))
        raise AuditUsageError(f"{where} has no attribute {attr!r}; it defines: {', '.join(public) or 'nothing public'}")
    obj = getattr(source, attr)
    if isinstance(obj, nn.Module):
        return obj, attr
    if callable(obj):
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise AuditUsageError(
                f"{attr} in {where} is a callable that needs arguments; --target needs an nn.Module "
                "or a zero-argument callable returning one"
            ) from None
        except ValueError:
            pass  # no signature to inspect (some builtins): just call it
        built = obj()
        if not isinstance(built, nn.Module):
            raise AuditUsageError(f"{attr}() returned {type(built).__name__}, not an nn.Module")
        return built, attr
    raise AuditUsageError(f"{attr} in {where} is a {type(obj).__name__}, neither an nn.Module nor a factory of one")


def _import_file(path: str) -> ModuleType:
    file = Path(path)
    if not file.is_file():
        raise AuditUsageError(f"--target file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_moe_audit_target_{abs(hash(file.resolve()))}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise AuditUsageError(f"cannot import {path}: {type(e).__name__}: {e}") from None
    return module


def _import_module(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise AuditUsageError(f"cannot import {name}: {type(e).__name__}: {e}") from None


def parse_input(spec: str, seed: int = 0) -> tuple[Tensor, int | None]:
    """``float:B,T,D[,...]`` -> (normal features, None); ``tokens:B,T,V`` -> (ids in [0, V), V)."""
    kind, sep, dims = spec.partition(":")
    usage = "--input must be float:B,T,D (e.g. float:4,16,64) or tokens:B,T,V (e.g. tokens:4,32,256)"
    if not sep or kind not in ("float", "tokens"):
        raise AuditUsageError(f"{usage}, got {spec!r}")
    try:
        sizes = [int(s) for s in dims.split(",")]
    except ValueError:
        raise AuditUsageError(f"{usage}; the sizes must be integers, got {spec!r}") from None
    if any(s < 1 for s in sizes):
        raise AuditUsageError(f"{usage}; sizes must be positive, got {spec!r}")
    if (kind == "tokens" and len(sizes) != 3) or (kind == "float" and len(sizes) < 3):
        raise AuditUsageError(f"{usage}, got {spec!r}")
    if sizes[1] < 2:
        raise AuditUsageError(f"T must be at least 2 to have a future to perturb, got {spec!r}")
    gen = torch.Generator().manual_seed(seed)
    if kind == "tokens":
        b, t, v = sizes
        return torch.randint(0, v, (b, t), generator=gen), v
    return torch.randn(*sizes, generator=gen), None


def _default_input(module: nn.Module, seed: int, spec: str) -> tuple[Tensor, int | None]:
    if isinstance(module, (Router, MoELayer)):
        return parse_input(f"float:{DEFAULT_BATCH},{DEFAULT_SEQ},{module.d_model}", seed)
    emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        return parse_input(f"tokens:{DEFAULT_BATCH},{DEFAULT_SEQ},{emb.num_embeddings}", seed)
    raise AuditUsageError(f"cannot tell what {spec} takes: pass --input float:B,T,D or --input tokens:B,T,V")
