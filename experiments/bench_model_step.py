"""Time one training step of the gpu100m MoE model per router family: tokens/s and MFU.

Commands (from the repository root):

    PYTHONPATH=. python experiments/bench_model_step.py --bench-json experiments/results/bench_kernels-<date>-<gpu>.json
    PYTHONPATH=. python experiments/bench_model_step.py --matmul-tflops 700 --routers topk,expert_choice
    PYTHONPATH=. python experiments/bench_model_step.py --dry-run          # CPU, "tiny" preset, a few seconds

A step is forward + backward + AdamW step + ``moe.update_routers`` on a batch of random byte
tokens, in bf16 autocast (fp32 master weights) with the MoE backend ``--backend`` ("auto":
triton on CUDA). Each router family is set to about top-2 compute: topk and capacity with
top_k=2, the expert-choice family with capacity_factor=2 (C = 2 * T / E per sequence).

MFU = model FLOPs per step / step time / the bf16 matmul rate measured by
``experiments/bench_kernels.py`` in the same session (``--bench-json``, or ``--matmul-tflops``).
Model FLOPs count what the step really computed: 6 x (non-expert, non-embedding parameters)
per token, 6 x 3*D*F per kept (token, expert) assignment (read from the routings), and the
causal attention matmuls (6 * T * D per token per layer, half of the full square).

Writes ``<out-dir>/bench_model_step-<date>-<gpu>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe.layer import MoELayer, update_routers
from moe.model import MoETransformer, preset

ROUTERS = {
    "topk": {"top_k": 2},
    "capacity": {"top_k": 2, "capacity_factor": 1.25},
    "expert_choice": {"capacity_factor": 2.0},
    "ec_threshold": {"capacity_factor": 2.0},
    "ec_predictor": {"capacity_factor": 2.0},
}


def step_flops(model: MoETransformer, routings: list, batch: int, seq: int) -> float:
    """Forward+backward FLOPs of one step (see module docstring)."""
    cfg = model.cfg
    expert_params = sum(p.numel() for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters())
    dense_params = sum(p.numel() for p in model.parameters()) - expert_params - model.embed.weight.numel()
    if cfg.tie_embeddings:  # the output projection is the embedding matrix: a real matmul
        dense_params += model.embed.weight.numel()
    tokens = batch * seq
    flops = 6 * dense_params * tokens
    flops += sum(6 * 3 * cfg.d_model * cfg.moe_d_ff * r.num_assignments for r in routings)
    flops += 6 * cfg.n_layers * seq * cfg.d_model * tokens
    return float(flops)


def time_router(router: str, args, device: torch.device, base: str) -> dict:
    torch.manual_seed(0)
    cfg = preset(
        base, router=router, router_options=ROUTERS[router], backend=args.backend, max_seq_len=max(args.seq, 8)
    )
    model = MoETransformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device.type, dtype=dtype):
            out = model(inputs, targets)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_routers(model)
        return out

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        out = step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    flops = step_flops(model, out.routings, args.batch, args.seq)
    result = {
        "router_options": ROUTERS[router],
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch * args.seq / step_s,
        "model_TFLOPs": flops / step_s / 1e12,
        "loss": out.loss.item(),
        "assignments_per_token": sum(r.num_assignments for r in out.routings)
        / len(out.routings)
        / (args.batch * args.seq),
        "params": model.num_parameters(),
    }
    if args.matmul_tflops:
        result["mfu"] = result["model_TFLOPs"] / args.matmul_tflops
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, 'tiny' preset, tiny batch")
    p.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated router names")
    p.add_argument("--backend", default="auto", help="MoE data path: auto, triton or torch")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; dry run 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; dry run 16)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry run 1)")
    p.add_argument("--bench-json", default=None, help="bench_kernels JSON whose measured matmul rate sets MFU")
    p.add_argument(
        "--matmul-tflops", type=float, default=None, help="bf16 matmul rate for MFU (overrides --bench-json)"
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    dry = args.dry_run
    for name, full, tiny in (("batch", 8, 2), ("seq", 1024, 16), ("warmup", 3, 1), ("steps", 10, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive")
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        p.error(f"unknown routers {bad}; known: {', '.join(ROUTERS)}")
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run on a CPU")
    if args.matmul_tflops is None and args.bench_json:
        args.matmul_tflops = json.loads(Path(args.bench_json).read_text())["floors"]["matmul_TFLOPs"]
    device = torch.device("cpu" if dry else "cuda")
    base = "tiny" if dry else "gpu100m"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-dry-run"
    results = {
        "gpu": gpu,
        "preset": base,
        "backend": args.backend,
        "batch": args.batch,
        "seq": args.seq,
        "matmul_TFLOPs": args.matmul_tflops,
        "routers": {},
    }
    for router in tqdm(routers, desc="routers", file=sys.stdout):
        results["routers"][router] = time_router(router, args, device, base)

    print(f"\n{base} on {gpu}, batch {args.batch} x {args.seq}, backend {args.backend}, bf16 autocast")
    print(f"{'router':>14} {'step_ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'k_avg':>6} {'loss':>7}")
    for router, r in results["routers"].items():
        mfu = f"{r['mfu']:6.3f}" if "mfu" in r else f"{'n/a':>6}"
        print(
            f"{router:>14} {r['step_ms']:9.2f} {r['tokens_per_s']:10.0f} {r['model_TFLOPs']:8.2f} {mfu} "
            f"{r['assignments_per_token']:6.2f} {r['loss']:7.3f}"
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    path = out_dir / f"bench_model_step-{stamp}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-').lower()}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    results["path"] = str(path)
    return results


if __name__ == "__main__":
    main()
