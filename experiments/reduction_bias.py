"""How wrong is a low-precision gradient sum? The error and the bias of summing W workers'
gradients in fp16, bf16 and fp32, in the orders collectives use, against the exact (float64)
sum; then what the bf16 all-reduce option (``--grad-reduce-dtype bf16``) does to training.

    python experiments/reduction_bias.py                     # table + JSON + figure (~1 min), then training (~4 min)
    python experiments/reduction_bias.py --no-train --workers 8 64 1024

Gradients: n elements, worker w's value g_w[i] = s_i (m_i + e_wi): a shared mean m (the
signal), per-worker noise e and a per-element scale s_i log-uniform in [1e-3, 1] (layers and
parameters differ by orders of magnitude). Two regimes (``REGIMES``): ``noisy``, m ~ N(0, 1e-4^2)
and e ~ N(0, 1e-3^2) (minibatch noise ten times the signal: the sum grows like sqrt W), and
``agreeing``, m ~ N(0, 1e-3^2), e ~ N(0, 1e-4^2) (the workers' gradients agree, as they do for
large per-worker batches and for many parameters early in training: the sum grows like W).
Reductions, each in the working dtype (every partial sum rounded to it):

* ``ring``: a ring all-reduce's reduce-scatter: each chunk's partial sum travels the ring and
  every hop adds one worker's value: a sequential sum x_0 + x_1 + ... + x_{W-1};
* ``tree``: pairwise (recursive halving / doubling): log2 W levels of sums of equal-sized parts;
* ``ring_prescaled``: every worker divides by W before the ring sum (an averaging all-reduce
  that pre-multiplies, to avoid overflow);
* ``fp32_accumulate``: inputs rounded to the dtype (what travels), the ring sum accumulated in fp32.

Reported per (dtype, order, W), over ``--trials`` draws: ``rel_error`` ||sum - exact|| / ||exact||,
``bias`` <sum - exact, exact> / ||exact||^2 (a systematic shrink or growth along the true
gradient: this part accumulates over steps instead of averaging out), ``elem_error`` (median
over elements of |sum - exact| / |exact|: the small-scale parameters, invisible in the norm),
``zeroed`` (fraction of elements with a non-zero exact sum that came out exactly 0). The first row where
rel_error reaches 10% (an order of magnitude above the dtype's rounding) is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from moe.extras import pyplot
from moe.parallel.launch import ok_values, run_local
from moe.training import TrainConfig, train

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ORDERS = ("ring", "tree", "ring_prescaled", "fp32_accumulate")
REGIMES = {"noisy": (1e-4, 1e-3), "agreeing": (1e-3, 1e-4)}
"""regime -> (std of the shared mean m, std of the per-worker noise e)."""


def gradients(num_workers: int, n: int, seed: int, regime: str) -> torch.Tensor:
    """float64 [W, n]: the workers' gradients (module docstring), exactly representable in fp32."""
    mean_std, noise_std = REGIMES[regime]
    g = torch.Generator().manual_seed(seed)
    scale_n = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-3, 0, generator=g)
    mean_n = mean_std * torch.randn(n, dtype=torch.float64, generator=g)
    noise_Wn = noise_std * torch.randn(num_workers, n, dtype=torch.float64, generator=g)
    return (scale_n * (mean_n + noise_Wn)).float().double()


def ring_sum(x_Wn: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    acc_n = x_Wn[0].to(acc_dtype)
    for w in range(1, x_Wn.shape[0]):
        acc_n = acc_n + x_Wn[w].to(acc_dtype)
    return acc_n


def tree_sum(x_Wn: torch.Tensor) -> torch.Tensor:
    while x_Wn.shape[0] > 1:
        if x_Wn.shape[0] % 2:
            x_Wn = torch.cat([x_Wn[:-2], (x_Wn[-2] + x_Wn[-1]).unsqueeze(0)])
            continue
        x_Wn = x_Wn[0::2] + x_Wn[1::2]
    return x_Wn[0]


def reduce(x_Wn: torch.Tensor, dtype: torch.dtype, order: str) -> torch.Tensor:
    """float64 [n]: the sum over workers of ``x_Wn`` (float64 inputs) as ``order`` computes it in ``dtype``."""
    low_Wn = x_Wn.to(dtype)
    if order == "ring":
        return ring_sum(low_Wn, dtype).double()
    if order == "tree":
        return tree_sum(low_Wn).double()
    if order == "ring_prescaled":
        return ring_sum((x_Wn / x_Wn.shape[0]).to(dtype), dtype).double() * x_Wn.shape[0]
    if order == "fp32_accumulate":
        return ring_sum(low_Wn, torch.float32).double()
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def measure(workers: list[int], n: int, trials: int) -> list[dict]:
    rows = []
    for regime in REGIMES:
        for num_workers in workers:
            rows += _measure_one(regime, num_workers, n, trials)
    return rows


def _measure_one(regime: str, num_workers: int, n: int, trials: int) -> list[dict]:
    draws = [gradients(num_workers, n, seed, regime) for seed in range(trials)]
    exact = [x.sum(0) for x in draws]
    rows = []
    for dname, dtype in DTYPES.items():
        for order in ORDERS:
            if dname == "fp32" and order == "fp32_accumulate":
                continue  # the same as ring
            rel, bias, zeroed, elem = [], [], [], []
            for x_Wn, s_n in zip(draws, exact):
                err_n = reduce(x_Wn, dtype, order) - s_n
                rel.append(float(err_n.norm() / s_n.norm()))
                elem.append(float((err_n.abs() / s_n.abs()).median()))
                bias.append(float((err_n * s_n).sum() / s_n.square().sum()))
                zeroed.append(float((((s_n + err_n) == 0) & (s_n != 0)).double().mean()))
            rows.append(
                {
                    "regime": regime,
                    "workers": num_workers,
                    "dtype": dname,
                    "order": order,
                    "rel_error": float(np.mean(rel)),
                    "bias": float(np.mean(bias)),
                    "bias_se": float(np.std(bias, ddof=1) / np.sqrt(trials)) if trials > 1 else None,
                    "elem_error": float(np.mean(elem)),
                    "zeroed": float(np.mean(zeroed)),
                }
            )
    return rows


def table(rows: list[dict], workers: list[int]) -> str:
    lines = [
        "| regime | dtype | order | " + " | ".join(f"W={w}" for w in workers) + " |",
        "|" + "---|" * (3 + len(workers)),
        "| | | | " + " | ".join("rel err / bias / elem err" for _ in workers) + " |",
    ]
    for regime in REGIMES:
        for dname in DTYPES:
            for order in ORDERS:
                cells = [r for r in rows if r["regime"] == regime and r["dtype"] == dname and r["order"] == order]
                if cells:
                    lines.append(
                        f"| {regime} | {dname} | {order} | "
                        + " | ".join(
                            f"{r['rel_error']:.1e} / {r['bias']:+.1e} / {r['elem_error']:.1e}"
                            + (f" ({100 * r['zeroed']:.0f}% zeroed)" if r["zeroed"] > 0.005 else "")
                            for r in cells
                        )
                        + " |"
                    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot("the reduction-bias figure")

    fig, axes = plt.subplots(1, len(REGIMES), figsize=(11, 4), sharey=True)
    for ax, regime in zip(axes, REGIMES):
        for dname, style in zip(DTYPES, ("-", "--", ":")):
            for order, color in zip(ORDERS, ("C0", "C1", "C2", "C3")):
                cells = [r for r in rows if r["regime"] == regime and r["dtype"] == dname and r["order"] == order]
                if cells:
                    ax.plot(
                        [r["workers"] for r in cells],
                        [r["rel_error"] for r in cells],
                        style,
                        color=color,
                        marker="o",
                        ms=3,
                        label=f"{dname} {order}",
                    )
        ax.axhline(0.1, color="grey", lw=0.5)
        ax.set(xscale="log", yscale="log", xlabel="workers W", title=f"{regime} gradients: relative error of the sum")
    axes[0].set_ylabel("||sum - exact|| / ||exact||")
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _train_worker(rank: int, world: int, steps: int, dtype: str) -> dict:
    cfg = TrainConfig.flat(
        preset="tiny", steps=steps, batch_size=16, grad_reduce_dtype=dtype, eval_windows=64, progress=False, log_every=0
    )
    res = train(cfg)
    diffs = [h.get("grad_reduce_rel_diff", 0.0) for h in res.history]
    return {
        "val_loss": res.final_eval["teacher_forced_loss"],
        "grad_reduce_rel_diff": float(np.mean(diffs)) if diffs else 0.0,
        "train_loss_last50": float(np.mean([h["loss"] for h in res.history[-50:]])) if res.history else None,
        "config": dataclasses.asdict(cfg),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    p.add_argument("--elements", type=int, default=4096)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--no-train", action="store_true", help="skip the training comparison")
    p.add_argument(
        "--json",
        type=Path,
        help="results JSON (default: experiments/results/reduction_bias-DATE.json); figure next to it",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(args.workers, args.elements, args.trials)
    md = table(rows, args.workers)
    print(md)
    first = next((r for r in sorted(rows, key=lambda r: r["workers"]) if r["rel_error"] >= 0.1), None)
    if first:
        print(
            f"first order-of-magnitude error: {first['regime']} gradients, {first['dtype']} {first['order']} at W={first['workers']} "
            f"(rel error {first['rel_error']:.2f}, bias {first['bias']:+.3f})"
        )
    result = {
        "date": date.today().isoformat(),
        "elements": args.elements,
        "trials": args.trials,
        "rows": rows,
        "first_order_of_magnitude_error": first,
        "measure_s": time.perf_counter() - t0,
    }
    if not args.no_train:
        training = {}
        for dtype in ("fp32", "bf16"):
            t1 = time.perf_counter()
            training[dtype] = ok_values(run_local(_train_worker, 2, args.train_steps, dtype, timeout_s=1800.0))[0]
            training[dtype]["wall_s"] = time.perf_counter() - t1
            print(f"training, 2 gloo processes, {args.train_steps} steps, all-reduce in {dtype}: {training[dtype]}")
        training["val_loss_change_bf16_minus_fp32"] = training["bf16"]["val_loss"] - training["fp32"]["val_loss"]
        result["training"] = {"steps": args.train_steps, "world": 2, "preset": "tiny", **training}
    json_path = args.json or RESULTS / f"reduction_bias-{result['date']}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(md + "\n")
    plot(rows, json_path.with_suffix(".png"))
    print(f"wrote {json_path} (+ .md, .png)")
    return result


if __name__ == "__main__":
    main()
