"""What exact mode (``moe.exact_mode``) costs at the router study's shape, against the normal path
measured interleaved in the same run, and that it is exact there.

    PYTHONPATH=.:kernels nice python experiments/bench_exact.py            # about 3 min on the shared 2 cores
    PYTHONPATH=.:kernels nice python experiments/bench_exact.py --quick    # smoke run, under a minute

The shape: nanoGPT's CPU "baby" model (4 blocks, d_model 128, 4 heads, T=64, batch 12), 8 experts
of width 256, ``topk`` top-2, byte vocabulary, one torch thread. Three workloads, each in fp32 and
bf16: the teacher-forced forward (eval, no gradient), a training forward + backward, and decoding
the batch's 64 positions one token at a time through the KV cache. Each round runs every
(workload, dtype, path) once in a shuffled order; the figure is the median process CPU time over
rounds (the machine is shared: CPU time is what this process got) and the ratio exact / normal.
The check: inside exact mode, decoding's logits equal the teacher-forced ones bit for bit.

Writes ``experiments/results/bench_exact-<date>-cpu1.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
import moe  # noqa: E402
from experiments.timing import interleaved  # noqa: E402
from moe.model import ModelConfig, MoETransformer  # noqa: E402

SHAPE = dict(d_model=128, n_layers=4, n_heads=4, num_experts=8, moe_d_ff=256, max_seq_len=64, vocab_size=256)
BATCH, T = 12, 64


def workloads(model: MoETransformer, idx_BT: torch.Tensor) -> dict:
    def forward():
        with torch.no_grad():
            model.eval()(idx_BT)

    def train_step():
        out = model.train()(idx_BT, idx_BT)
        (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)

    def decode():
        model.eval()
        with torch.no_grad():
            cache = model.init_cache(BATCH, T)
            for s in range(T):
                model(idx_BT[:, s : s + 1], cache=cache)

    return {"forward": forward, "train_step": train_step, "decode": decode}


def exact_check(model: MoETransformer, idx_BT: torch.Tensor) -> bool:
    model.eval()
    with torch.no_grad(), moe.exact_mode():
        full = model(idx_BT).logits
        cache = model.init_cache(BATCH, T)
        steps = torch.cat([model(idx_BT[:, s : s + 1], cache=cache).logits for s in range(T)], 1)
    return torch.equal(full, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="2 rounds, for a smoke run")
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = p.parse_args()
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(1)
    torch.manual_seed(0)
    idx_BT = torch.randint(0, SHAPE["vocab_size"], (BATCH, T))
    models = {
        name: MoETransformer(ModelConfig(**SHAPE, router_options={"top_k": 2}), init_seed=0).to(dtype)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }

    def job(fn, path: str):
        def run() -> None:
            with moe.exact_mode() if path == "exact" else nullcontext():
                fn()

        return run

    jobs = {
        (work, dtype, path): job(fn, path)
        for dtype, model in models.items()
        for work, fn in workloads(model, idx_BT).items()
        for path in ("normal", "exact")
    }
    samples = interleaved(jobs, rounds)
    rows = []
    for work in ("forward", "train_step", "decode"):
        for dtype in models:
            normal = samples[(work, dtype, "normal")].median("cpu")
            exact = samples[(work, dtype, "exact")].median("cpu")
            rows.append(dict(workload=work, dtype=dtype, normal_s=normal, exact_s=exact, ratio=exact / normal))
    checks = {dtype: exact_check(model, idx_BT) for dtype, model in models.items()}
    write(args.out, rows, checks, rounds)


def write(out: Path, rows: list[dict], checks: dict, rounds: int) -> None:
    stamp = dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"bench_exact-{stamp}-cpu1"
    meta = dict(date=stamp, torch=torch.__version__, threads=1, rounds=rounds, shape=SHAPE, batch=BATCH, seq_len=T)
    base.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, decode_equals_forward=checks), indent=2))
    lines = [
        f"# Exact mode at the study's baby shape ({stamp}, torch {torch.__version__}, 1 thread, loaded shared machine)",
        "",
        f"Median process CPU time over {rounds} interleaved rounds; batch {BATCH} x {T} tokens.",
        "",
        "| workload | dtype | normal (s) | exact (s) | exact / normal |",
        "|---|---|---|---|---|",
        *(
            f"| {r['workload']} | {r['dtype']} | {r['normal_s']:.4f} | {r['exact_s']:.4f} | {r['ratio']:.2f}x |"
            for r in rows
        ),
        "",
        "Inside exact mode, decoding one token at a time equals the teacher-forced logits bit for bit: "
        + ", ".join(f"{d} {'yes' if ok else 'NO'}" for d, ok in checks.items()),
        "",
    ]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
