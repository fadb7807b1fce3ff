"""MoELayer forward+backward against a dense SwiGLU of the same active FLOPs and a naive
mask-per-expert loop, all measured in this run, interleaved round by round
(``experiments/timing.py``); prints wall-time medians and ratios.

    python experiments/bench_layer.py                       # N=4096, D=256, F=512, E=8, k=2
    python experiments/bench_layer.py --tokens 8192 --router capacity --threads 2
    python experiments/bench_layer.py --json experiments/results/bench_layer.json

The dense baseline is one SwiGLU of width k*F over all N tokens: the same multiply-adds
as routing every token to k experts of width F, with no routing, sorting or gathering. A
third row runs only the per-expert SwiGLU on rows already sorted by expert: the cost of
splitting one big matmul into E smaller ones, which no routing code can remove on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
import moe  # noqa: E402
from causal_moe_kernels.reference import grouped_swiglu, sort_by_expert  # noqa: E402
from experiments.timing import interleaved  # noqa: E402
from moe.model import SwiGLU  # noqa: E402


def naive_mask_loop(layer: moe.MoELayer, x_BTD: torch.Tensor) -> torch.Tensor:
    """The common Hugging Face style: for each expert, find its tokens by mask, run, index_add."""
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(-1, d)
    w_NE = layer.router(x_BTD).dense().reshape(b * t, -1)
    y_ND = torch.zeros_like(x_ND)
    ex = layer.experts
    for e in range(layer.num_experts):
        idx = torch.nonzero(w_NE[:, e]).squeeze(-1)
        h = F.silu(x_ND[idx] @ ex.w_gate[e]) * (x_ND[idx] @ ex.w_up[e])
        y_ND = y_ND.index_add(0, idx, (h @ ex.w_down[e]) * w_NE[idx, e, None])
    return y_ND.view(b, t, d)


def fwd_bwd(fn, x: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``fn`` on a fresh leaf copy of ``x``."""
    return lambda: fn(x.detach().requires_grad_(True)).square().mean().backward()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="N = B*T (B=8)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--router", default="topk", choices=["topk", "capacity"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[moe.MoELayer, SwiGLU, torch.Tensor]:
    """The MoE layer, the dense SwiGLU of width k*F, and the input x [8, N/8, D] (seed 0)."""
    torch.manual_seed(0)
    layer = moe.MoELayer(args.d_model, args.d_ff, args.experts, router=args.router, top_k=args.top_k)
    dense = SwiGLU(args.d_model, args.top_k * args.d_ff)
    return layer, dense, torch.randn(8, args.tokens // 8, args.d_model)


def compared_paths(layer: moe.MoELayer, dense: SwiGLU, x_BTD: torch.Tensor) -> dict[str, tuple[Callable, torch.Tensor]]:
    """name -> (function, its input): the computations whose forward+backward is timed.

    ``dense``: the k*F-wide SwiGLU over all N tokens; ``expert_matmuls_only``: the per-expert
    SwiGLU on x's rows already sorted by expert under the layer's routing; ``moe_layer``;
    ``naive_mask_loop``.
    """
    with torch.no_grad():
        routing = layer.router(x_BTD)
        order_A, counts_E = sort_by_expert(routing.expert, layer.num_experts)
        x_sorted_AD = x_BTD.reshape(-1, layer.d_model)[routing.token[order_A]]
    ex, counts = layer.experts, counts_E.tolist()
    return {
        "dense": (dense, x_BTD),
        "expert_matmuls_only": (lambda xi: grouped_swiglu(xi, counts, ex.w_gate, ex.w_up, ex.w_down), x_sorted_AD),
        "moe_layer": (layer, x_BTD),
        "naive_mask_loop": (lambda xi: naive_mask_loop(layer, xi), x_BTD),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = compared_paths(*build(args))
    results = {"config": vars(args)}
    samples = interleaved({name: fwd_bwd(fn, inp) for name, (fn, inp) in paths.items()}, args.reps, warmup=2)
    results.update({f"{name}_s": samples[name].median("wall") for name in paths})
    results["moe_over_dense"] = results["moe_layer_s"] / results["dense_s"]
    results["expert_matmuls_over_dense"] = results["expert_matmuls_only_s"] / results["dense_s"]
    results["naive_over_dense"] = results["naive_mask_loop_s"] / results["dense_s"]
    results["naive_over_moe"] = results["naive_mask_loop_s"] / results["moe_layer_s"]

    print(
        f"N={args.tokens} D={args.d_model} F={args.d_ff} E={args.experts} k={args.top_k} "
        f"router={args.router} threads={args.threads}, forward+backward, wall-time median of {args.reps} interleaved rounds"
    )
    print(f"{'path':<28}{'seconds':>10}{'x dense':>10}")
    rows = (
        ("dense SwiGLU (k*F wide)", "dense_s"),
        ("expert matmuls only", "expert_matmuls_only_s"),
        ("MoELayer (torch backend)", "moe_layer_s"),
        ("naive mask-per-expert loop", "naive_mask_loop_s"),
    )
    for name, key in rows:
        print(f"{name:<28}{results[key]:>10.4f}{results[key] / results['dense_s']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
