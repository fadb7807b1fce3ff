"""``moe-audit``: check that routers, MoE layers and models keep their causality claims.

    moe-audit                                     # every built-in router, as router / layer / tiny model
    moe-audit --target mypkg.models:build --input tokens:4,32,256
    moe-audit --target path/to/file.py:layer --input float:4,16,64 --json audit.json
    python -m moe.audit --modes eval --trials 4 --seed 1
    moe-audit --target path/to/file.py:layer --modes eval --trials 1   # the quick check (about 4x faster)

Exit codes: 0 no leak (built-in suite: no leak it does not claim) and every claim holds;
1 a leak (``--target``), or a false claim either way: a target claiming causality, batch
invariance or decode consistency it lacks, or claiming a leak, batch interference or decode
inconsistency the audit cannot demonstrate; 2 usage error (unimportable target, a target that
calls ``sys.exit`` at import, in its factory or in a forward, a name that is neither a module
nor a factory, a malformed --input, an unknown --output field, no CUDA for --device cuda) or
a target the audit could not run at all (it fails on the example, a forward runs past
--forward-timeout, or past twice it in native code, which ends the command through
:mod:`moe.audit.watchdog`, two identical calls differ because it is stateful, or no
future-perturbation probe ran), or, with no leak found, in one of the modes (the others are
reported, and a leak found in one is exit 1). Never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn
from tqdm import tqdm

from moe.audit import watchdog
from moe.audit.engine import FORWARD_TIMEOUT_S, MODES, QUICK_MODES, TRIALS, audit
from moe.audit.report import SUMMARY_LEGEND, AuditReport, reports_to_json, summary_table
from moe.audit.runner import exit_text
from moe.audit.suite import builtin_targets
from moe.audit.target import AuditUsageError
from moe.routing import Claims

DEFAULT_BATCH, DEFAULT_SEQ = 4, 16
"""B and T of the input when --input is left out and the target says its width / vocabulary."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LONG_AUDIT_S = 5.0
"""--target: a progress line per probe on stderr once the audit has run this long."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-audit",
        description="Causality audit: does the output at position t ignore inputs at positions > t? "
        "Without --target, audits every built-in router (alone, in an MoELayer, in the tiny model) "
        "against its claims.",
        epilog="Pre-commit check: --quick (eval mode, one random future per cut, half the adversarial cuts). Exit codes: "
        "0 no leak and every claim holds; 1 a leak (--target), an INCONCLUSIVE result, or a false claim, either way "
        "(a claimed leak the audit cannot demonstrate is false too); 2 usage error, or a target that could not be run.",
    )
    # what --target is, what it is given and what of it is audited
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
    p.add_argument(
        "--output",
        metavar="NAMES",
        help="comma-separated outputs to audit when the target returns a tuple / dict / dataclass: keys, attributes "
        "or tuple indices, dotted for nested ones (router_logits.0); a name keeps everything under it (default: every "
        "[B, T, ...] or [B*T, ...] tensor it returns)",
    )
    p.add_argument(
        "--special-ids",
        metavar="IDS",
        help="comma-separated token ids the target treats specially (end of document, padding, separators): put in "
        "futures besides the smallest and largest ids and the example's own (token inputs only)",
    )
    p.add_argument("--device", default="cpu", help="device to run --target on, e.g. cuda or cuda:1 (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast --target's floating parameters and float input to this dtype (default: leave as built); "
        "tolerances scale with its resolution",
    )
    p.add_argument(
        "--modes", default=None, help="comma-separated modes to audit (default: train,eval; eval with --quick)"
    )
    p.add_argument(
        "--trials", type=int, default=None, help="random perturbations per cut position (default: 2; 1 with --quick)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a pre-commit check: eval mode only (unless --modes), one random future per cut, half the adversarial "
        "cuts; a leak of training mode only (e.g. ec_predictor) is not looked for",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for inputs, perturbations and built-in targets (default: 0)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the reports as JSON to PATH")
    p.add_argument(
        "--forward-timeout",
        type=float,
        default=FORWARD_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a target whose forward does not return within this many seconds is not audited (exit 2; default: "
        f"{FORWARD_TIMEOUT_S:g}; enforced in the main thread on POSIX; a single long native op ends first)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for the built-in suite, whose tensors are tiny; torch's default for --target)",
    )
    p.add_argument(
        "--zoo",
        action="store_true",
        help="audit every sparse MoE block of the installed Hugging Face transformers ([zoo] extra) and the routers of "
        "Megatron-Core, DeepSpeed, fairscale and torchtitan ([zoo-frameworks], installed with --no-deps)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print the per-probe table of every target (and, for --target, of its probes)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--no-agreement",
        action="store_true",
        help="--target: skip the routing agreement figures of a model (full forward vs decoding, batch, chunked "
        "prefill, bf16; the bf16 ones run a copy of the model); the built-in suite never measures them",
    )
    return p


def console_main() -> int:
    """``moe-audit`` and ``python -m moe.audit``: :func:`main` under the watchdog that stops the
    command when a forward never returns from native code (:mod:`moe.audit.watchdog`)."""
    return watchdog.supervised(main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.modes = args.modes if args.modes is not None else ",".join(QUICK_MODES if args.quick else MODES)
    args.trials = args.trials if args.trials is not None else (1 if args.quick else TRIALS)
    try:
        modes = _parse_modes(args.modes)
        if args.trials < 1:
            raise AuditUsageError(f"--trials must be >= 1, got {args.trials}")
        if args.threads is not None and args.threads < 1:
            raise AuditUsageError(f"--threads must be >= 1, got {args.threads}")
        if not args.forward_timeout > 0:
            raise AuditUsageError(f"--forward-timeout must be a positive number of seconds, got {args.forward_timeout}")
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
        else:
            for flag in ("input", "output", "dtype", "special_ids"):
                if getattr(args, flag):
                    raise AuditUsageError(
                        f"--{flag.replace('_', '-')} only applies to --target (the built-in suite chooses its own)"
                    )
            if args.device != "cpu":
                raise AuditUsageError("--device only applies to --target (the built-in suite runs on the CPU)")
            reports = _audit_builtins(args, modes)
    except AuditUsageError as e:
        print(f"moe-audit: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # the target's own sys.exit outside a forward: never read as a verdict
        print(f"moe-audit: error: the target called {exit_text(e)}; the audit stopped", file=sys.stderr)
        return 2
    except Exception as e:  # whatever else went wrong: one line and exit 2, never a traceback
        print(f"moe-audit: error: the audit itself failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    _print(reports, args, elapsed)
    if args.json:
        try:
            Path(args.json).write_text(reports_to_json(reports) + "\n")
        except OSError as e:
            print(f"moe-audit: error: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 2
    return exit_code(reports, user_target=bool(args.target))


def exit_code(reports: list[AuditReport], user_target: bool) -> int:
    """2 if a target could not be audited; else 1 for a false claim (either way), an INCONCLUSIVE
    mode (no leak shown, none ruled out) or, for a user target, any leak; else 2 if a mode of a
    target could not be audited; else 0. The built-in suite's leaks are claimed, so only claims
    (and inconclusive modes) count there."""
    if any(r.error for r in reports):
        return 2
    if any(r.false_claims or r.inconclusive_in for r in reports) or (user_target and any(r.leaks for r in reports)):
        return 1
    return 2 if any(r.modes_not_audited for r in reports) else 0


def _print(reports: list[AuditReport], args: argparse.Namespace, elapsed: float) -> None:
    if args.target:
        r = reports[0]
        if r.error:  # once, as the one-line error of exit 2: no table, no verdict
            print(f"moe-audit: error: {r.summary()}", file=sys.stderr)
            return
        for mode, why in r.modes_not_audited.items():  # the others were audited: their report below
            print(f"moe-audit: error: {r.name}: NOT AUDITED in {mode} mode: {why}", file=sys.stderr)
        if args.verbose:
            print(r.table(), end="\n\n")
        print(r.summary())
        return
    if args.verbose:
        for r in reports:
            print(r.table(), end="\n\n")
    print(summary_table(reports))
    print(textwrap.fill(SUMMARY_LEGEND, width=100))
    print(
        f"\n{len(reports)} targets audited in {elapsed:.1f} s (modes: {args.modes}, trials: {args.trials}, seed: {args.seed})"
    )
    for r in reports:
        if r.error:
            print(f"NOT AUDITED: {r.name}: {r.error}")
            continue
        for mode, why in r.modes_not_audited.items():
            print(f"NOT AUDITED in {mode} mode: {r.name}: {why}")
    bad = [r for r in reports if r.false_claims]
    if bad:
        print(f"FALSE CLAIMS in {len(bad)} target(s):")
        for r in bad:
            print(f"  {r.name}: {'; '.join(r.false_claims)}")
    unsure = [r for r in reports if r.inconclusive_in and not r.false_claims]
    for r in unsure:
        print(f"INCONCLUSIVE: {r.name} in {', '.join(r.inconclusive_in)} mode (rerun with --verbose for the figures)")
    if not bad and not unsure and not any(r.error or r.modes_not_audited for r in reports):
        print("every claim holds (the suite's leaks are claimed by the routers that have them)")


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
        reports.append(
            audit(
                bt.build(),
                bt.example(),
                modes=modes,
                trials=args.trials,
                seed=args.seed,
                name=bt.name,
                forward_timeout=args.forward_timeout,
                agreement=False,
                quick=args.quick,
            )
        )
    bar.close()
    return reports


def _audit_user_target(args: argparse.Namespace, modes: tuple[str, ...]) -> AuditReport:
    with contextlib.redirect_stdout(sys.stderr):  # what the target prints as it loads: stdout is the report's
        module, name = load_target(args.target)
    example, vocab = (
        parse_input(args.input, args.seed) if args.input else _default_input(module, args.seed, args.target)
    )
    device = _device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        module.to(device=device, dtype=dtype)
    except Exception as e:  # the user's module refused the move: a usage problem here
        raise AuditUsageError(
            f"cannot move {name} to {args.device} {args.dtype or ''}: {type(e).__name__}: {e}"
        ) from None
    example = example.to(device=device, dtype=dtype if example.is_floating_point() and dtype else None)
    start = time.perf_counter()

    def progress(line: str) -> None:  # long audits only: quick ones print their summary and nothing else
        if not args.no_progress and time.perf_counter() - start >= LONG_AUDIT_S:
            print(f"moe-audit: {name}: {line}", file=sys.stderr, flush=True)

    return audit(
        module,
        example,
        modes=modes,
        trials=args.trials,
        seed=args.seed,
        name=name,
        vocab_size=vocab,
        output=args.output,
        special_ids=_parse_ids(args.special_ids),
        forward_timeout=args.forward_timeout,
        quick=args.quick,
        progress=progress,
        agreement=not args.no_agreement,
    )


def _parse_ids(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise AuditUsageError(f"--special-ids takes comma-separated integers, got {text!r}") from None


def _device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise AuditUsageError(f"--device {spec!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AuditUsageError(f"--device {spec}: CUDA is not available on this machine")
    return device


def load_target(spec: str) -> tuple[nn.Module, str]:
    """Import ``pkg.module:name`` or ``path/to/file.py:name`` and return (module, display name)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise AuditUsageError(f"--target must be pkg.module:name or path/to/file.py:name, got {spec!r}")
    source = _import_file(where) if where.endswith(".py") or os.sep in where or "/" in where else _import_module(where)
    if not hasattr(source, attr):
        raise AuditUsageError(
            f"{where} has no {attr!r}; its modules and factories: {', '.join(_candidates(source)) or 'none'}"
        )
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
        try:
            built = obj()
        except SystemExit as e:
            raise AuditUsageError(
                f"the target could not be loaded: {attr}() in {where} called {exit_text(e)}"
            ) from None
        except Exception as e:  # the user's factory failed: report it, no traceback
            raise AuditUsageError(f"{attr}() in {where} raised {type(e).__name__}: {e}") from None
        if not isinstance(built, nn.Module):
            raise AuditUsageError(f"{attr}() returned {type(built).__name__}, not an nn.Module")
        return built, attr
    raise AuditUsageError(f"{attr} in {where} is a {type(obj).__name__}, neither an nn.Module nor a factory of one")


def _candidates(source: ModuleType) -> list[str]:
    """Names --target could take from ``source``: nn.Module instances, and the classes and
    functions defined in it (not imported) that can be called without arguments."""
    out = []
    for name, obj in vars(source).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, nn.Module):
            out.append(name)
        elif callable(obj) and getattr(obj, "__module__", None) == source.__name__:
            try:
                inspect.signature(obj).bind()
            except (TypeError, ValueError):
                continue
            out.append(f"{name}()")
    return sorted(out)


def _import_file(path: str) -> ModuleType:
    file = Path(path)
    if not file.is_file():
        raise AuditUsageError(f"--target file {path} does not exist")
    name = f"_moe_audit_target_{abs(hash(file.resolve()))}"
    # Its folder first on the path, as `python path/to/file.py` puts it: the file (or its factory,
    # later) may import the modules beside it (`from model import GPT` next to nanoGPT's train.py).
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses (and pickling) look their
    # module up in sys.modules, e.g. to resolve `from __future__ import annotations` strings.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise AuditUsageError(
            f"the target could not be loaded: it called {exit_text(e)} when {path} was imported"
        ) from None
    except Exception as e:
        del sys.modules[name]
        raise AuditUsageError(f"cannot import {path}: {type(e).__name__}: {e}") from None
    return module


def _import_module(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except SystemExit as e:
        raise AuditUsageError(
            f"the target could not be loaded: it called {exit_text(e)} when {name} was imported"
        ) from None
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
    """Features of width ``d_model`` for a module that declares its claims and that width (a router,
    an ``MoELayer``, any user's module doing the same), else token ids below the size of its first
    ``nn.Embedding``."""
    if isinstance(getattr(module, "claims", None), Claims) and isinstance(getattr(module, "d_model", None), int):
        return parse_input(f"float:{DEFAULT_BATCH},{DEFAULT_SEQ},{module.d_model}", seed)
    emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        return parse_input(f"tokens:{DEFAULT_BATCH},{DEFAULT_SEQ},{emb.num_embeddings}", seed)
    raise AuditUsageError(f"cannot tell what {spec} takes: pass --input float:B,T,D or --input tokens:B,T,V")
