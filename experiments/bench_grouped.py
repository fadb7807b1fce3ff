"""The grouped-GEMM backend (``backend="grouped_mm"``, ``torch._grouped_mm``) against the reference
backend (``"torch"``, the one the router study runs) and a dense SwiGLU of equal active FLOPs, on CPU,
forward + backward, interleaved in one process; prints the ratios.

    PYTHONPATH=.:kernels nice python experiments/bench_grouped.py                 # 2-4 min on the shared cores
    PYTHONPATH=.:kernels nice python experiments/bench_grouped.py --label quiet   # appended to the file names
    PYTHONPATH=.:kernels python experiments/bench_grouped.py --quick              # smoke run, seconds

Two shapes (top-2 over 8 experts in both):

* ``layer``: experiments/bench_layer.py's, N = 4,096 tokens (8 x 512), D 256, F 512;
* ``baby``: the router study's baby size (experiments/router_study.py ``SIZES["baby"]``), 12 x 64
  tokens, D 128, F 256; and there also the whole baby model (4 blocks, every one MoE, byte
  vocabulary), a loss forward + backward, against the dense model of width 512.

Per shape: the MoE layer with each backend (same weights, same routing) and the dense SwiGLU of
width k*F over all N tokens (the same multiply-adds). One torch thread. Each round runs every
configuration's burst of calls in an order shuffled per round (``experiments/timing.py``); the
figures are medians over rounds of the burst's time per call, wall clock and process CPU time (on a shared machine the CPU time
is the steadier: it is what this process got), and per-round ratios give the spread.

Writes ``experiments/results/bench_grouped-<date>-cpu1[-<label>].{json,md}`` with the load
average before and after.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import Clocks, Samples, interleaved, ratio  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from moe.model import MoETransformer, SwiGLU, preset  # noqa: E402

SHAPES = {
    "layer": {"batch": 8, "seq": 512, "d_model": 256, "d_ff": 512, "experts": 8, "top_k": 2},
    "baby": {"batch": 12, "seq": 64, "d_model": 128, "d_ff": 256, "experts": 8, "top_k": 2},
}
QUICK_SHAPES = {
    "layer": {"batch": 2, "seq": 16, "d_model": 32, "d_ff": 64, "experts": 4, "top_k": 2},
    "baby": {"batch": 2, "seq": 8, "d_model": 16, "d_ff": 32, "experts": 4, "top_k": 2},
}
BABY_MODEL = {"n_layers": 4, "n_heads": 4}
"""The baby model beyond SHAPES["baby"]: experiments/router_study.py SIZES["baby"]."""
BACKENDS = ("torch", "grouped_mm")


def layer_modules(s: dict, seed: int = 0) -> tuple[dict[str, torch.nn.Module], torch.Tensor]:
    """(name -> module, x): the dense SwiGLU (k*F wide) and the layer per backend (same weights)."""
    torch.manual_seed(seed)
    layer = MoELayer(s["d_model"], s["d_ff"], s["experts"], router="topk", top_k=s["top_k"])
    modules: dict[str, torch.nn.Module] = {"dense": SwiGLU(s["d_model"], s["top_k"] * s["d_ff"])}
    for backend in BACKENDS:
        modules[backend] = copy.deepcopy(layer)
        modules[backend].backend = backend
    return modules, torch.randn(s["batch"], s["seq"], s["d_model"])


def layer_fns(s: dict) -> dict[str, Callable[[], None]]:
    """name -> one forward + backward of :func:`layer_modules`' module."""
    modules, x = layer_modules(s)
    return {name: _fwd_bwd(m, x) for name, m in modules.items()}


def model_fns(s: dict, seed: int = 0) -> dict[str, Callable[[], None]]:
    """The baby model's loss forward + backward: dense (width k*F) and MoE per backend."""
    shape = dict(d_model=s["d_model"], max_seq_len=s["seq"], moe_d_ff=s["d_ff"], num_experts=s["experts"], **BABY_MODEL)
    moe = dict(shape, router="topk", router_options={"top_k": s["top_k"]})
    idx = torch.randint(
        0, preset("tiny").vocab_size, (s["batch"], s["seq"] + 1), generator=torch.Generator().manual_seed(seed)
    )
    models = {"dense model": MoETransformer(preset("tiny", **shape, moe_every=0, d_ff=s["top_k"] * s["d_ff"]))}
    for backend in BACKENDS:
        models[f"{backend} model"] = MoETransformer(preset("tiny", **moe, backend=backend), init_seed=seed)

    def step(model: MoETransformer) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            out = model(idx[:, :-1], idx[:, 1:])
            (out.loss + out.aux_loss).backward()

        return run

    return {name: step(m) for name, m in models.items()}


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        module.zero_grad(set_to_none=True)
        module(x.detach().requires_grad_()).square().mean().backward()

    return run


def summarise(samples: dict[str, Samples], base: str, pairs: list[tuple[str, str]]) -> dict:
    """Medians per configuration, and for each (num, den) pair the ratio of medians with the
    per-round ratios' min / median / max (time ratios: below 1 is faster)."""
    out: dict = {"ms": {}, "ratios": {}}
    for name, v in samples.items():
        out["ms"][name] = {c: v.median(c) * 1e3 for c in ("wall", "cpu")}
    for num, den in [*pairs, *((n, base) for n in samples if n != base)]:
        key = f"{num} / {den}"
        if key in out["ratios"]:
            continue
        cpu = ratio(samples[num], samples[den], "cpu")
        out["ratios"][key] = {
            "cpu": cpu["ratio"],
            "wall": ratio(samples[num], samples[den], "wall")["ratio"],
            **{f"cpu_{k}": v for k, v in cpu.items() if k != "ratio"},
        }
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--burst", type=int, default=3, help="consecutive calls of one configuration per round")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke run")
    p.add_argument("--label", default="", help="appended to the results' file names")
    p.add_argument("--out-dir", default="experiments/results")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.burst < 1:
        p.error("--rounds and --burst must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds, warmup = (2, 1) if args.quick else (args.rounds, 2)
    load_before, clocks = os.getloadavg(), Clocks()
    fns = {f"layer {k}": v for k, v in layer_fns(shapes["layer"]).items()}
    fns |= {f"baby {k}": v for k, v in layer_fns(shapes["baby"]).items()}
    fns |= {f"baby {k}": v for k, v in model_fns(shapes["baby"]).items()}
    samples = interleaved(fns, rounds, warmup=warmup, burst=args.burst)
    results = {}
    for shape, names, base in (
        ("layer", ["dense", *BACKENDS], "dense"),
        ("baby layer", ["dense", *BACKENDS], "dense"),
        ("baby model", [f"{n} model" for n in ("dense", *BACKENDS)], "dense model"),
    ):
        prefix = "layer" if shape == "layer" else "baby"
        sub = {n: samples[f"{prefix} {n}"] for n in names}
        grouped, torch_ = names[-1], names[-2]
        results[shape] = summarise(sub, base, [(grouped, torch_)])
    result = {
        "date": dt.date.today().isoformat(),
        "command": " ".join(["PYTHONPATH=.:kernels nice python experiments/bench_grouped.py", *(argv or sys.argv[1:])]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "shapes": shapes,
        "baby_model": BABY_MODEL,
        "rounds": rounds,
        "burst": args.burst,
        "results": results,
        "seconds": clocks.lap()[0],
    }
    write(result, Path(args.out_dir), args.label)
    return result


def markdown(r: dict) -> str:
    la, lb = r["load_average_before"], r["load_average_after"]
    lines = [
        f"# bench_grouped {r['date']} (torch {r['torch']}, {r['threads']} thread, "
        f"load {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} before, {lb[0]:.1f} / {lb[1]:.1f} / {lb[2]:.1f} after)",
        "",
        f"`{r['command']}`; forward + backward, medians of {r['rounds']} interleaved rounds x {r['burst']} calls.",
        "",
        "| shape | configuration | CPU ms | wall ms |",
        "|---|---|---:|---:|",
    ]
    for shape, v in r["results"].items():
        for name, ms in v["ms"].items():
            lines.append(f"| {shape} | {name} | {ms['cpu']:.2f} | {ms['wall']:.2f} |")
    lines += [
        "",
        "| shape | time ratio | CPU | wall | per round: min | median | max |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, v in r["results"].items():
        for key, x in v["ratios"].items():
            lines.append(
                f"| {shape} | {key} | {x['cpu']:.3f} | {x['wall']:.3f} | {x['cpu_per_round_min']:.3f} "
                f"| {x['cpu_per_round_median']:.3f} | {x['cpu_per_round_max']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path, label: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_grouped-{result['date']}-cpu{result['threads']}{'-' + label if label else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
