"""Benchmark the Triton MoE kernels against torch baselines and the physical floors.

Commands (from the repository root):

    PYTHONPATH=.:kernels python experiments/bench_kernels.py                 # GPU: check, then shapes A, B, decode
    PYTHONPATH=.:kernels python experiments/bench_kernels.py --shapes A      # one shape
    PYTHONPATH=.:kernels python experiments/bench_kernels.py --dry-run       # CPU, tiny shapes, Triton interpreter
    PYTHONPATH=.:kernels python experiments/bench_kernels.py --dry-run --out-dir /tmp/bench

What it does, in order:

1. Correctness on the device: the two fused backends, ``moe_ffn_triton`` (our Triton kernels)
   and ``moe_ffn_grouped_mm`` (the ``grouped_mm`` backend, PyTorch's ``torch._grouped_mm``),
   against the fp32 torch reference path (bf16 on GPU, fp32 in the dry run), output and every
   gradient (the same losses), each also rerun and compared bitwise; the torch eager baseline
   is checked the same way, and triton against grouped_mm directly.
2. Floors measured in the same run: HBM bandwidth (a large device copy) and the bf16 matmul
   rate (a large square matmul).
3. Per shape (A: T=16384 D=2048 F=1408 E=64 k=6; V, VeOmni issue 460's: T=32768 D=2048 F=768
   E=128 k=8; B: T=8192 D=1024 F=4096 E=8 k=2; decode: T=128 with A's widths), over several
   input sets (the timed call cycles through them): routing metadata, dispatch + combine
   (kernels only) against min bytes / bandwidth; layer forward and forward+backward for
   triton, grouped_mm, torch eager (argsort + index_select + per-expert matmuls + index_add)
   and a dense SwiGLU of the same FLOPs; the GEMM floor = useful FLOPs / measured matmul rate;
   each path's TFLOP/s and its fraction of the GPU's nominal bf16 peak.

Timings come from ``experiments/timing.py``: on a GPU ``cuda_ms`` (``triton.testing.do_bench``:
CUDA events, L2 flushed before every run, mean); the dry run times one call after one warm-up
call, wall clock: it only shows that every path runs.

Output: a table on stdout and ``<out-dir>/bench_kernels-<date>-<gpu>.json`` with ``gpu``,
``dispatch_combine_fraction_of_bandwidth``, ``layer_fwd_bwd_over_gemm_floor``,
``speedup_vs_torch_eager`` and ``triton_over_grouped_mm_fwd_bwd`` (each a dict by shape), the
floors, every timing, ``goals`` (shape A, the Triton kernels) and ``auto_rule`` (whether the
Triton kernels were equal to and faster than grouped_mm at every shape: what
``moe.experts.CUDA_AUTO`` waits for, docs/kernels.md).
Goals on an H200 at shape A: dispatch + combine >= 0.70 of the bandwidth floor, layer fwd+bwd
<= 1.35x the GEMM floor, >= 2x faster than torch eager.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from causal_moe_kernels.dispatch_combine import combine, dispatch  # noqa: E402
from causal_moe_kernels.metadata import routing_metadata  # noqa: E402
from causal_moe_kernels.moe_ffn import moe_ffn_triton  # noqa: E402
from causal_moe_kernels.reference import moe_ffn_reference  # noqa: E402
from causal_moe_kernels.torch_grouped import moe_ffn_grouped_mm  # noqa: E402
from experiments.timing import cuda_ms, interleaved  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: T tokens of width D, E experts of width F, top-k routing."""

    name: str
    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k


GPU_SHAPES = {
    "A": Shape("A", 16384, 2048, 1408, 64, 6),
    "V": Shape("V", 32768, 2048, 768, 128, 8),
    "B": Shape("B", 8192, 1024, 4096, 8, 2),
    "decode": Shape("decode", 128, 2048, 1408, 64, 6),
}
DRY_SHAPES = {
    "A": Shape("A", 32, 32, 32, 8, 6),
    "V": Shape("V", 32, 32, 16, 16, 8),
    "B": Shape("B", 32, 32, 64, 4, 2),
    "decode": Shape("decode", 4, 32, 32, 8, 6),
}


# -- baselines -----------------------------------------------------------------------------


def moe_ffn_torch_eager(x_ND, token_A, expert_A, weight_A, w_gate_EDF, w_up_EDF, w_down_EFD):
    """The usual eager MoE: argsort, index_select, a matmul loop over experts, index_add."""
    e = w_gate_EDF.shape[0]
    order_A = torch.argsort(expert_A, stable=True)
    token_P = token_A[order_A]
    x_PD = x_ND.index_select(0, token_P)
    outs = []
    for i, x_e in enumerate(x_PD.split(torch.bincount(expert_A, minlength=e).tolist())):
        outs.append((F.silu(x_e @ w_gate_EDF[i]) * (x_e @ w_up_EDF[i])) @ w_down_EFD[i])
    rows_PD = torch.cat(outs) * weight_A[order_A].unsqueeze(-1).to(x_ND.dtype)
    return torch.zeros_like(x_ND).index_add(0, token_P, rows_PD)


def dense_swiglu(x_MD, w_gate_DF, w_up_DF, w_down_FD):
    return (F.silu(x_MD @ w_gate_DF) * (x_MD @ w_up_DF)) @ w_down_FD


PATHS: dict[str, Callable] = {
    "triton": moe_ffn_triton,
    "grouped_mm": moe_ffn_grouped_mm,
    "torch_eager": moe_ffn_torch_eager,
}
FUSED = ("triton", "grouped_mm")
"""The backends (their failures fail the run; each is rerun and compared bitwise)."""
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Nominal dense bf16 tensor-core rate of the SXM parts (NVIDIA's H100 / H200 datasheets, without
sparsity), by a substring of the device name; MFU-style fractions use the measured matmul rate too."""
GOALS = {
    "dispatch_combine_fraction_of_bandwidth": 0.70,
    "layer_fwd_bwd_over_gemm_floor": 1.35,
    "speedup_vs_torch_eager": 2.0,
}
"""Shape A, the Triton kernels: at least, at most, at least."""


# -- inputs and timing ---------------------------------------------------------------------


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """x, a top-k routing from random router logits, expert weights, an output gradient."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, d, f, e, k = shape.tokens, shape.d_model, shape.d_ff, shape.num_experts, shape.top_k

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    logits_NE = torch.randn(n, e, generator=gen)
    top_NK = torch.topk(logits_NE, k, dim=-1)
    weight_NK = torch.softmax(top_NK.values, dim=-1)
    return {
        "x": randn(n, d),
        "token": torch.arange(n).repeat_interleave(k).to(device),
        "expert": top_NK.indices.reshape(-1).to(device),
        "weight": weight_NK.reshape(-1).to(device),
        "w_gate": randn(e, d, f, scale=d**-0.5),
        "w_up": randn(e, d, f, scale=d**-0.5),
        "w_down": randn(e, f, d, scale=f**-0.5),
        "grad": randn(n, d),
    }


def ffn_call(fn: Callable, inp: dict, backward: bool):
    """One forward (and backward through autograd.grad, so nothing accumulates)."""
    leaves = [inp[k].requires_grad_(backward) for k in ("x", "weight", "w_gate", "w_up", "w_down")]
    y = fn(inp["x"], inp["token"], inp["expert"], inp["weight"], *leaves[2:])
    if not backward:
        return [y]
    return [y, *torch.autograd.grad(y, leaves, inp["grad"])]


def cycling(fns: list[Callable]) -> Callable:
    """A callable that runs fns[0], fns[1], ... in turn (several input sets under one timer)."""
    state = {"i": 0}

    def run():
        out = fns[state["i"] % len(fns)]()
        state["i"] += 1
        return out

    return run


def timer(device: torch.device) -> Callable[[Callable], float]:
    """Milliseconds per call: ``cuda_ms`` (do_bench: L2 flushed, mean) on CUDA; one warm call then one timed on CPU."""
    if device.type == "cuda":
        return cuda_ms
    return lambda fn: interleaved({"call": fn}, 1, warmup=1)["call"].median("wall") * 1e3


def measure_floors(device: torch.device, bench: Callable, dry_run: bool) -> dict:
    """HBM bandwidth (GB/s) from a device copy, bf16 matmul rate (TFLOP/s) from a square matmul.

    Returns the rates with what they were measured from: bytes moved and ms of the copy,
    size and ms of the matmul; and the device's nominal bf16 peak where ``BF16_PEAK_TFLOPS``
    knows it (None otherwise).
    """
    numel = 2**20 if dry_run else 2**30  # 2 GiB of bf16 each way on the GPU
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()  # read once, written once
    n = 256 if dry_run else 8192
    dtype = torch.float32 if dry_run else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_ms = bench(lambda: a @ b)
    return {
        "hbm_bandwidth_GBps": copy_bytes / (copy_ms * 1e-3) / 1e9,
        "matmul_TFLOPs": 2 * n**3 / (matmul_ms * 1e-3) / 1e12,
        "matmul_dtype": str(dtype),
        "copy_bytes": copy_bytes,
        "copy_ms": copy_ms,
        "matmul_size": n,
        "matmul_ms": matmul_ms,
        "bf16_peak_TFLOPs": bf16_peak(torch.cuda.get_device_name(device) if device.type == "cuda" else ""),
    }


def bf16_peak(device_name: str) -> float | None:
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_name), None)


# -- correctness ---------------------------------------------------------------------------


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_correctness(device: torch.device, dtype: torch.dtype, dry_run: bool) -> dict:
    """Each path against the fp32 reference on the same (dtype-rounded) inputs; the backends
    (``FUSED``) also rerun bitwise, and against each other (``triton_vs_grouped_mm_rel``).

    ``ok`` is False if any path that ran is off, or a backend fails or is not bitwise
    reproducible; the torch eager baseline failing to run is reported and does not count.
    """
    shape = Shape("check", 32, 32, 32, 8, 2) if dry_run else Shape("check", 2048, 512, 384, 16, 4)
    inp = make_inputs(shape, dtype, device, seed=123)
    ref_inp = {k: (v.float() if v.is_floating_point() else v) for k, v in inp.items()}
    ref = ffn_call(moe_ffn_reference, ref_inp, backward=True)
    names = ["y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    report = {"dtype": str(dtype), "tolerance_rel": tol, "paths": {}}
    ok, outputs = True, {}
    for path, fn in PATHS.items():
        try:
            got = ffn_call(fn, inp, backward=True)
        except Exception as exc:  # reported; only the eager baseline may be missing
            report["paths"][path] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            ok &= path not in FUSED
            continue
        errs = {n: rel_error(g, r) for n, g, r in zip(names, got, ref)}
        entry = {"rel_error": errs, "ok": max(errs.values()) <= tol}
        if path in FUSED:
            again = ffn_call(fn, inp, backward=True)
            entry["bitwise_reproducible"] = all(torch.equal(a, b) for a, b in zip(got, again))
            entry["ok"] &= entry["bitwise_reproducible"]
            outputs[path] = got
        ok &= entry["ok"]  # a wrong baseline makes its speed-up meaningless too
        report["paths"][path] = entry
    if len(outputs) == len(FUSED):
        report["triton_vs_grouped_mm_rel"] = {
            n: rel_error(a, b) for n, a, b in zip(names, outputs["triton"], outputs["grouped_mm"])
        }
    report["ok"] = ok
    return report


# -- per-shape benchmark -------------------------------------------------------------------


def bench_shape(
    shape: Shape, device: torch.device, dtype: torch.dtype, bench: Callable, floors: dict, sets: int
) -> dict:
    inputs = [make_inputs(shape, dtype, device, seed=s) for s in range(sets)]
    elt = torch.tensor([], dtype=dtype).element_size()
    n, d, f, a = shape.tokens, shape.d_model, shape.d_ff, shape.assignments
    out: dict = {"shape": asdict(shape), "ms": {}}
    ms = out["ms"]

    metas = [routing_metadata(i["token"], i["expert"], n, shape.num_experts) for i in inputs]
    ms["routing_metadata"] = bench(
        cycling([lambda i=i: routing_metadata(i["token"], i["expert"], n, shape.num_experts) for i in inputs])
    )
    rows = [torch.randn(a, d, device=device).to(dtype) for _ in inputs]
    ms["dispatch"] = bench(cycling([lambda i=i, m=m: dispatch(i["x"], m) for i, m in zip(inputs, metas)]))
    ms["combine"] = bench(
        cycling([lambda i=i, m=m, r=r: combine(r, i["weight"], m) for i, m, r in zip(inputs, metas, rows)])
    )
    # Minimum traffic: dispatch reads x once and writes A rows; combine reads A rows (+ weights
    # and indices) and writes N rows.
    min_bytes = (n * d + a * d) * elt + (a * d + n * d) * elt + a * (4 + 4 + 4)
    floor_ms = min_bytes / (floors["hbm_bandwidth_GBps"] * 1e9) * 1e3
    out["dispatch_combine_floor_ms"] = floor_ms
    out["dispatch_combine_fraction_of_bandwidth"] = floor_ms / (ms["dispatch"] + ms["combine"])

    for path, fn in PATHS.items():
        for backward in (False, True):
            key = f"{path}_{'fwd_bwd' if backward else 'fwd'}"
            try:
                ms[key] = bench(cycling([lambda i=i, b=backward: ffn_call(fn, i, b) for i in inputs]))
            except Exception as exc:  # _grouped_mm missing or unsupported here
                ms[key] = None
                out.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:300]
    dense = [torch.randn(a, d, device=device, dtype=dtype, requires_grad=True) for _ in range(1)]
    w = inputs[0]
    dense_w = [
        w["w_gate"][0].detach().requires_grad_(),
        w["w_up"][0].detach().requires_grad_(),
        w["w_down"][0].detach().requires_grad_(),
    ]
    gy = torch.randn(a, d, device=device, dtype=dtype)
    ms["dense_same_flops_fwd"] = bench(lambda: dense_swiglu(dense[0], *dense_w))
    ms["dense_same_flops_fwd_bwd"] = bench(
        lambda: torch.autograd.grad(dense_swiglu(dense[0], *dense_w), [dense[0], *dense_w], gy)
    )

    fwd_flops = 2 * a * d * f * 3  # three matmuls forward
    useful_flops = 3 * fwd_flops  # twice that backward
    gemm_floor_ms = useful_flops / (floors["matmul_TFLOPs"] * 1e12) * 1e3
    out["gemm_floor_fwd_bwd_ms"] = gemm_floor_ms
    out["layer_fwd_bwd_over_gemm_floor"] = ms["triton_fwd_bwd"] / gemm_floor_ms
    out["speedup_vs_torch_eager"] = ms["torch_eager_fwd_bwd"] / ms["triton_fwd_bwd"]
    out["triton_over_dense_fwd_bwd"] = ms["triton_fwd_bwd"] / ms["dense_same_flops_fwd_bwd"]
    if ms.get("grouped_mm_fwd_bwd"):
        out["triton_over_grouped_mm_fwd_bwd"] = ms["triton_fwd_bwd"] / ms["grouped_mm_fwd_bwd"]
        out["grouped_mm_fwd_bwd_over_gemm_floor"] = ms["grouped_mm_fwd_bwd"] / gemm_floor_ms
        out["grouped_mm_speedup_vs_torch_eager"] = ms["torch_eager_fwd_bwd"] / ms["grouped_mm_fwd_bwd"]
    out["TFLOPs"], out["fraction_of_matmul_rate"], out["fraction_of_bf16_peak"] = {}, {}, {}
    for path in PATHS:
        for kind, flops in (("fwd", fwd_flops), ("fwd_bwd", useful_flops)):
            key = f"{path}_{kind}"
            if ms.get(key):
                rate = flops / (ms[key] * 1e-3) / 1e12
                out["TFLOPs"][key] = rate
                out["fraction_of_matmul_rate"][key] = rate / floors["matmul_TFLOPs"]
                if floors.get("bf16_peak_TFLOPs"):
                    out["fraction_of_bf16_peak"][key] = rate / floors["bf16_peak_TFLOPs"]
    return out


def profile_backends(shape: Shape, device: torch.device, dtype: torch.dtype) -> str:
    """torch.profiler's table of each backend's forward + backward (3 calls after a warm one),
    ops sorted by their own device time (CPU time in the dry run): where a goal's time goes."""
    from torch.profiler import ProfilerActivity, profile

    inp = make_inputs(shape, dtype, device, seed=0)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    tables = []
    for path in FUSED:
        ffn_call(PATHS[path], inp, backward=True)
        with profile(activities=activities) as prof:
            for _ in range(3):
                ffn_call(PATHS[path], inp, backward=True)
            if cuda:
                torch.cuda.synchronize()
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=15)
        tables.append(f"== {path}, shape {shape.name} {asdict(shape)}, 3 forward + backward calls\n{table}")
    return "\n\n".join(tables) + "\n"


def print_table(results: dict) -> None:
    cols = [
        "meta",
        "disp",
        "comb",
        "bw_frac",
        "tri_fb",
        "gmm_fb",
        "eager_fb",
        "dense_fb",
        "floor",
        "x_floor",
        "x_eager",
    ]
    cols.append("tri/gmm")
    print("\n" + " ".join(f"{c:>9}" for c in ["shape", *cols]) + "   (ms unless a ratio)")
    for name, r in results["shapes"].items():
        m = r["ms"]
        vals = [
            m["routing_metadata"],
            m["dispatch"],
            m["combine"],
            r["dispatch_combine_fraction_of_bandwidth"],
            m["triton_fwd_bwd"],
            m.get("grouped_mm_fwd_bwd"),
            m["torch_eager_fwd_bwd"],
            m["dense_same_flops_fwd_bwd"],
            r["gemm_floor_fwd_bwd_ms"],
            r["layer_fwd_bwd_over_gemm_floor"],
            r["speedup_vs_torch_eager"],
            r.get("triton_over_grouped_mm_fwd_bwd"),
        ]
        print(" ".join([f"{name:>9}"] + [f"{v:9.3f}" if v is not None else f"{'n/a':>9}" for v in vals]))
        rates = ", ".join(f"{k} {v:.1f}" for k, v in r["TFLOPs"].items())
        print(f"{'':>9} TFLOP/s: {rates}")


def judge(results: dict) -> dict:
    """``goals`` (shape A, the Triton kernels, against ``GOALS``) and ``auto_rule``: the Triton
    kernels correct, bitwise reproducible and faster than grouped_mm forward + backward at
    every timed shape (what moving ``backend="auto"`` on CUDA to them needs)."""
    out: dict = {}
    a = results["shapes"].get("A")
    if a is not None:
        out["goals"] = {
            key: {"value": a[key], "goal": goal, "met": a[key] <= goal if "floor" in key else a[key] >= goal}
            for key, goal in GOALS.items()
        }
    paths = results["correctness"]["paths"]
    ratios = {n: r.get("triton_over_grouped_mm_fwd_bwd") for n, r in results["shapes"].items()}
    out["auto_rule"] = {
        "triton_ok": paths["triton"].get("ok", False),
        "grouped_mm_ok": paths["grouped_mm"].get("ok", False),
        "triton_over_grouped_mm_fwd_bwd": ratios,
        "triton_equal_and_faster": paths["triton"].get("ok", False)
        and bool(ratios)
        and all(v is not None and v < 1 for v in ratios.values()),
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--shapes", default="A,V,B,decode", help="comma-separated subset of A, V, B, decode")
    p.add_argument("--sets", type=int, default=3, help="input sets the timed calls cycle through")
    p.add_argument("--profile", default="A", help="shape whose backends are profiled after timing ('' for none)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run on a CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    table = DRY_SHAPES if args.dry_run else GPU_SHAPES
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in names + ([args.profile] if args.profile else []) if s not in table]
    if bad:
        p.error(f"unknown shapes {bad}; known: {', '.join(table)}")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-dry-run"
    bench = timer(device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    path = out_dir / f"bench_kernels-{stamp}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-').lower()}.json"

    results: dict = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": str(dtype),
        "dry_run": args.dry_run,
        "input_sets": args.sets,
    }
    print(f"[bench_kernels] {gpu}, torch {results['torch']}, triton {results['triton']}, {dtype}")
    results["correctness"] = check_correctness(device, dtype, args.dry_run)
    for path_name, entry in results["correctness"]["paths"].items():
        print(f"  check {path_name:>17}: {json.dumps(entry)[:200]}")
    if not results["correctness"]["ok"]:
        print("  WARNING: a path failed its correctness check; its timings and ratios below are of wrong code")
    results["floors"] = measure_floors(device, bench, args.dry_run)
    print(f"  floors: {results['floors']}")
    results["shapes"] = {}
    path.write_text(json.dumps(results, indent=2))
    for name in tqdm(names, desc="shapes", file=sys.stdout):
        results["shapes"][name] = bench_shape(table[name], device, dtype, bench, results["floors"], args.sets)
        for key in (
            "dispatch_combine_fraction_of_bandwidth",
            "layer_fwd_bwd_over_gemm_floor",
            "speedup_vs_torch_eager",
            "triton_over_grouped_mm_fwd_bwd",
        ):
            results[key] = {n: r.get(key) for n, r in results["shapes"].items()}
        results.update(judge(results))
        path.write_text(json.dumps(results, indent=2))  # after every shape: a timeout keeps what was done
    print_table(results)
    if args.profile:
        profile_path = path.with_name(f"{path.stem}-profile-{args.profile}.txt")
        profile_path.write_text(profile_backends(table[args.profile], device, dtype))
        results["profile_path"] = str(profile_path)
        print(f"wrote {profile_path}")
    print(f"wrote {path}")
    results["path"] = str(path)
    if not results["correctness"]["ok"]:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
