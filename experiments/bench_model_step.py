"""Time one training step of the gpu100m MoE model per router, backend and mode: tokens/s and MFU.

Commands (from the repository root):

    PYTHONPATH=.:kernels python experiments/bench_model_step.py --bench-json experiments/results/bench_kernels-<date>-<gpu>.json
    PYTHONPATH=.:kernels python experiments/bench_model_step.py --matmul-tflops 700 --routers topk,expert_choice
    PYTHONPATH=.:kernels python experiments/bench_model_step.py --dry-run          # CPU, "tiny" preset, under a minute

A step is forward + backward + AdamW step + ``moe.update_routers`` on a batch of random byte
tokens, in bf16 autocast (fp32 master weights). Every router runs eager with each MoE backend
of ``--backends`` (grouped_mm, what ``backend="auto"`` runs on CUDA, and triton), and the
routers of ``--compile-routers`` run compiled too (``moe.parallel.compile.compile_blocks``, each
block's forward through torch.compile, as ``--compile`` trains) with the first backend. Each
router is set to about top-2 compute: topk, capacity, remoe, quantile and seq_topk with top_k=2, top_p with a target
of 2 experts per token, the expert-choice family with capacity_factor=2 (C = 2 * T / E per
sequence). Every configuration starts from the same weights and batch, so its first loss is the
same up to rounding: ``first_loss`` is reported beside each (the same losses across backends).

MFU = model FLOPs per step / step time / the bf16 matmul rate measured by
``experiments/bench_kernels.py`` in the same session (``--bench-json``, or ``--matmul-tflops``);
``mfu_peak`` divides by the nominal bf16 peak that run found for the device (``bf16_peak_TFLOPs``).
Model FLOPs count what the step really computed: 6 x (non-expert, non-embedding parameters)
per token, 6 x 3*D*F per kept (token, expert) assignment (read from the routings), and the
causal attention matmuls (6 * T * D per token per layer, half of the full square).

Writes ``<out-dir>/bench_model_step-<date>-<gpu>.json`` (after every configuration: a timeout
keeps what was done) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import interleaved, timed  # noqa: E402
from moe.experts import BACKENDS  # noqa: E402
from moe.layer import MoELayer, update_routers  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402
from moe.parallel.compile import compile_blocks  # noqa: E402

ROUTERS = {
    "topk": ("topk", {"top_k": 2}),
    "capacity": ("capacity", {"top_k": 2, "capacity_factor": 1.25, "capacity_scope": "prefix"}),
    "expert_choice": ("expert_choice", {"capacity_factor": 2.0}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 2.0}),
    "ec_threshold_population": ("ec_threshold", {"statistic": "population", "score": "sigmoid"}),
    "ec_predictor": ("ec_predictor", {"capacity_factor": 2.0}),
    "remoe": ("remoe", {"top_k": 2}),
    "top_p": ("top_p", {"target_experts": 2}),
    "quantile": ("quantile", {"top_k": 2}),
    "seq_topk": ("seq_topk", {"top_k": 2}),
    "token_rounding": ("token_rounding", {"top_k": 2}),
    "doc_pool": ("doc_pool", {"top_k": 2}),
    "hash": ("hash", {"top_k": 2}),
    "quantile_global": ("quantile_global", {"top_k": 2}),
    "sinkhorn": ("sinkhorn", {"top_k": 2}),
}
"""Configuration name -> (router, options): every registered router (``moe.list_routers()``); a
name the running tree does not register is reported as that configuration's error."""


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


def time_router(name: str, backend: str, compiled: bool, args, device: torch.device, base: str) -> dict:
    router, options = ROUTERS[name]
    cfg = preset(base, router=router, router_options=options, backend=backend, max_seq_len=max(args.seq, 8))
    model = MoETransformer(cfg, init_seed=0).to(device)
    if compiled:  # inductor on CUDA; the dry run traces with aot_eager (inductor's C++ build takes minutes on CPU)
        compile_blocks(model.blocks, **({} if device.type == "cuda" else {"backend": "aot_eager"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    idx = idx.to(device)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    dtype = torch.bfloat16
    last = []  # the latest step's output: its routings count the FLOPs, its loss is reported

    def step():
        with torch.autocast(device.type, dtype=dtype):
            out = model(inputs, targets)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_routers(model)
        last[:] = [out]

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    _, first_s, _ = timed(step, sync)  # includes compiling and the kernels' first launch
    first_loss = last[0].loss.item()
    for _ in range(args.warmup):
        step()
    sync()
    step_s = interleaved({"step": step}, 1, burst=args.steps, sync=sync)["step"].median("wall")
    out = last[0]
    flops = step_flops(model, out.routings, args.batch, args.seq)
    result = {
        "router": router,
        "router_options": options,
        "backend": backend,
        "compiled": compiled,
        "first_loss": first_loss,
        "first_step_s": first_s,
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
    if args.bf16_peak_tflops:
        result["mfu_peak"] = result["model_TFLOPs"] / args.bf16_peak_tflops
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, 'tiny' preset, tiny batch")
    p.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated configurations of ROUTERS")
    p.add_argument("--backends", default="grouped_mm,triton", help="comma-separated MoE backends, each run eager")
    p.add_argument(
        "--compile-routers", default="topk,capacity", help="configurations also run compiled, with the first backend"
    )
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; dry run 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; dry run 16)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry run 2)")
    p.add_argument("--bench-json", default=None, help="bench_kernels JSON whose measured matmul rate sets MFU")
    p.add_argument(
        "--matmul-tflops", type=float, default=None, help="bf16 matmul rate for MFU (overrides --bench-json)"
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    dry = args.dry_run
    for name, full, tiny in (("batch", 8, 2), ("seq", 1024, 16), ("warmup", 3, 1), ("steps", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive")
    routers, compiled = ([r.strip() for r in v.split(",") if r.strip()] for v in (args.routers, args.compile_routers))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [r for r in routers + compiled if r not in ROUTERS]
    if bad:
        p.error(f"unknown router configurations {bad}; known: {', '.join(ROUTERS)}")
    if not backends or any(b not in BACKENDS for b in backends):
        p.error(f"--backends takes some of {', '.join(BACKENDS)}, got {args.backends!r}")
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device: run with --dry-run on a CPU")
    args.bf16_peak_tflops = None
    if args.bench_json:
        floors = json.loads(Path(args.bench_json).read_text()).get("floors", {})
        args.bf16_peak_tflops = floors.get("bf16_peak_TFLOPs")
        if args.matmul_tflops is None:
            args.matmul_tflops = floors.get("matmul_TFLOPs")
    device = torch.device("cpu" if dry else "cuda")
    base = "tiny" if dry else "gpu100m"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-dry-run"
    results = {
        "gpu": gpu,
        "preset": base,
        "batch": args.batch,
        "seq": args.seq,
        "matmul_TFLOPs": args.matmul_tflops,
        "bf16_peak_TFLOPs": args.bf16_peak_tflops,
        "runs": {},
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    path = out_dir / f"bench_model_step-{stamp}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-').lower()}.json"
    runs = [(r, b, False) for r in routers for b in backends] + [(r, backends[0], True) for r in compiled]
    for name, backend, comp in tqdm(runs, desc="runs", file=sys.stdout):
        key = f"{name} {backend}{' compiled' if comp else ''}"
        try:
            results["runs"][key] = time_router(name, backend, comp, args, device, base)
        except Exception as exc:  # reported, and the other configurations still run
            results["runs"][key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        path.write_text(json.dumps(results, indent=2))

    print(f"\n{base} on {gpu}, batch {args.batch} x {args.seq}, bf16 autocast")
    print(f"{'run':>40} {'step_ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'k_avg':>6} {'loss0':>7}")
    for key, r in results["runs"].items():
        if "error" in r:
            print(f"{key:>40} {r['error'][:80]}")
            continue
        mfu = f"{r['mfu']:6.3f}" if "mfu" in r else f"{'n/a':>6}"
        print(
            f"{key:>40} {r['step_ms']:9.2f} {r['tokens_per_s']:10.0f} {r['model_TFLOPs']:8.2f} {mfu} "
            f"{r['assignments_per_token']:6.2f} {r['first_loss']:7.4f}"
        )
    print(f"wrote {path}")
    results["path"] = str(path)
    return results


if __name__ == "__main__":
    main()
