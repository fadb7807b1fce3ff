"""Decoding speed: ``MoETransformer.generate`` with the KV cache against recomputing every
prefix (what a router that is not decode-consistent needs), and the leakage study's causal
loss both ways. Every ratio is against a baseline measured in the same run.

    python experiments/bench_decode.py                  # tiny and small, T = 128 and 512 (~4 min on 2 CPU cores)
    python experiments/bench_decode.py --presets tiny --lengths 128 --routers topk capacity_prefix
    python experiments/bench_decode.py --json experiments/results/bench_decode-2026-11-29-cpu1.json   # the committed run

Generation: batch ``--batch`` of prompts of 8 tokens, greedy, until T tokens; decode tokens/s
= new tokens of the batch / wall time. The two ways must give the same tokens (checked).
Causal loss: ``moe.eval.evaluate`` with ``causal_method="cache"`` and ``"recompute"`` on the
``tiny`` preset (random weights) with the leakage study's evaluation settings per corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import timed  # noqa: E402
from moe.eval import evaluate  # noqa: E402
from moe.model import MoETransformer, preset  # noqa: E402

ROUTERS = {
    "topk": ("topk", {"top_k": 2}),
    "capacity_prefix": ("capacity", {"top_k": 2, "capacity_factor": 1.0, "capacity_scope": "prefix"}),
    "ec_threshold": ("ec_threshold", {"capacity_factor": 1.0}),
}
# The leakage study's evaluations (experiments/leakage_gap.py: QUICK, FULL and corpus_config);
# the full canary evaluation is the quick one with twice the windows.
EVALS = {
    "canary": dict(vocab=8, seq_len=8, num_windows=1024, causal_stride=1, batch_size=64),
    "text_quick": dict(vocab=256, seq_len=128, num_windows=32, causal_stride=8, batch_size=16),
    "text_full": dict(vocab=256, seq_len=128, num_windows=64, causal_stride=1, batch_size=16),
}
PROMPT = 8


def bench_generate(preset_name: str, seq_len: int, router: str, batch: int) -> dict:
    name, options = ROUTERS[router]
    torch.manual_seed(0)
    model = MoETransformer(preset(preset_name, router=name, router_options=options, max_seq_len=seq_len)).eval()
    prompt_BT = torch.randint(0, 256, (batch, PROMPT))
    new = seq_len - PROMPT
    cached, cache_s, _ = timed(lambda: model.generate(prompt_BT, new, temperature=0))
    recomputed, recompute_s, _ = timed(lambda: model.generate(prompt_BT, new, temperature=0, recompute=True))
    return {
        "preset": preset_name,
        "T": seq_len,
        "router": router,
        "batch": batch,
        "new_tokens": batch * new,
        "cache_tokens_per_s": batch * new / cache_s,
        "recompute_tokens_per_s": batch * new / recompute_s,
        "speedup": recompute_s / cache_s,
        "same_tokens": torch.equal(cached, recomputed),
    }


def bench_causal_loss(corpus: str, router: str) -> dict:
    name, options = ROUTERS[router]
    e = EVALS[corpus]
    torch.manual_seed(0)
    model = MoETransformer(
        preset("tiny", vocab_size=e["vocab"], router=name, router_options=options, max_seq_len=max(e["seq_len"], 8))
    )
    val = torch.randint(0, e["vocab"], (200_000,))
    kw = {k: e[k] for k in ("seq_len", "num_windows", "causal_stride", "batch_size")}
    cached, cache_s, _ = timed(lambda: evaluate(model, val, causal_method="cache", **kw))
    recomputed, recompute_s, _ = timed(lambda: evaluate(model, val, causal_method="recompute", **kw))
    return {
        "corpus": corpus,
        "router": router,
        **kw,
        "cache_s": cache_s,
        "recompute_s": recompute_s,
        "speedup": recompute_s / cache_s,
        "causal_loss_abs_diff": abs(cached["causal_loss"] - recomputed["causal_loss"]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512], help="T: prompt + generated tokens")
    p.add_argument("--routers", nargs="+", default=["topk", "capacity_prefix"], choices=list(ROUTERS))
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-eval", action="store_true", help="skip the causal-loss comparison")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.batch < 1 or any(t <= PROMPT for t in args.lengths):
        p.error(f"need --batch >= 1 and every length > {PROMPT}")
    torch.set_num_threads(args.threads)

    gen = []
    print(f"generate, batch {args.batch}, prompt {PROMPT}, greedy, {args.threads} thread(s)")
    print(f"{'preset':>7} {'T':>5} {'router':>16} {'cache tok/s':>12} {'recompute tok/s':>16} {'speedup':>8} same")
    for preset_name in args.presets:
        for t in args.lengths:
            for router in args.routers:
                r = bench_generate(preset_name, t, router, args.batch)
                gen.append(r)
                print(
                    f"{preset_name:>7} {t:>5} {router:>16} {r['cache_tokens_per_s']:12.0f} "
                    f"{r['recompute_tokens_per_s']:16.0f} {r['speedup']:7.1f}x {r['same_tokens']}",
                    flush=True,
                )
    causal = []
    if not args.no_eval:
        print("\ncausal loss of the leakage study's evaluations (tiny preset), cache vs recomputed prefixes")
        print(f"{'corpus':>10} {'router':>16} {'cache s':>8} {'recompute s':>12} {'speedup':>8} {'|diff|':>8}")
        for corpus in EVALS:
            for router in args.routers:
                r = bench_causal_loss(corpus, router)
                causal.append(r)
                print(
                    f"{corpus:>10} {router:>16} {r['cache_s']:8.2f} {r['recompute_s']:12.2f} {r['speedup']:7.1f}x "
                    f"{r['causal_loss_abs_diff']:8.1e}",
                    flush=True,
                )
    result = {"torch": torch.__version__, "threads": args.threads, "generate": gen, "causal_loss": causal}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
