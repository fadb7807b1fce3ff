"""Trainer vs server log-probabilities per router of the router study, with and without exact
mode and with routing replay (issue 56, item 4): which routers reach a difference of exactly
zero, and at what cost.

    PYTHONPATH=.:kernels nice python experiments/exact_study.py            # about 5 min on the shared 2 cores
    PYTHONPATH=.:kernels nice python experiments/exact_study.py --routers topk_aux expert_choice --dtypes bf16

Per router of the study (``router_study.ROUTERS``, causal and leaking sets), the baby size with
the byte vocabulary at its seed-0 initialisation (not trained: the study's trained models are not
kept in the repository), in eval mode, on 4 sequences of 64 random byte ids, in bf16 and fp32:

* server: decoding one token at a time through the KV cache (each token in the forward of its
  prefix for a router that cannot decode from a cache), recorded (``moe.agreement.run_decoding``);
* trainer: the teacher-forced forward of the same ids, in the same dtype.

The figure is max and mean |log p_server - log p_trainer| of each next token (252 tokens), for
four trainers: as is; replaying the server's recorded experts (``moe.replay_routing``); both
sides inside ``moe.exact_mode()``; both exact and replaying. Cost: the exact server + trainer's
process CPU time over the normal one's, one thread (a loaded shared machine).

Writes ``experiments/results/exact_study-<date>-cpu1.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

import moe
from moe.agreement import run_decoding, run_forward
from moe.exact import ExactnessWarning
from moe.model import ModelConfig, MoETransformer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_study  # noqa: E402  (the study's routers and sizes)

LABELS = router_study.SETS["causal"] + router_study.SETS["leaking"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TRAINERS = ("as is", "replay", "exact", "exact + replay")


def next_token_logp(logits_BTV: torch.Tensor, idx_BT: torch.Tensor) -> torch.Tensor:
    """float64 [B, T-1]: log p of each next token."""
    logp = torch.log_softmax(logits_BTV[:, :-1].double(), -1)
    return logp.gather(-1, idx_BT[:, 1:, None]).squeeze(-1)


def measure(label: str, dtype: torch.dtype, idx_BT: torch.Tensor) -> dict:
    router, options, _ = router_study.ROUTERS[label]
    cfg = ModelConfig(**router_study.SIZES["baby"], vocab_size=256, router=router, router_options=options)
    model = MoETransformer(cfg, init_seed=0).to(dtype).eval()
    row, seconds = {}, {}
    for exact in (False, True):
        with moe.exact_mode() if exact else nullcontext(), torch.no_grad():
            start = time.process_time()
            server = run_decoding(model, idx_BT)
            trainer = run_forward(model, idx_BT)
            seconds[exact] = time.process_time() - start
            with moe.replay_routing(model, server.record):
                replayed = run_forward(model, idx_BT)
        served = next_token_logp(server.logits, idx_BT)
        for name, run in (
            ("exact" if exact else "as is", trainer),
            ("exact + replay" if exact else "replay", replayed),
        ):
            gap = (next_token_logp(run.logits, idx_BT) - served).abs()
            row[name] = dict(max=gap.max().item(), mean=gap.mean().item())
    return dict(router=label, server=server.how, trainers=row, exact_cost=seconds[True] / seconds[False])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routers", nargs="+", default=LABELS, choices=LABELS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    idx_BT = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype in args.dtypes:
        for label in args.routers:
            with warnings.catch_warnings():  # the leaking routers say they cannot be exact: the table shows it
                warnings.simplefilter("ignore", ExactnessWarning)
                rows.append(dict(dtype=dtype, **measure(label, DTYPES[dtype], idx_BT)))
            print(rows[-1], flush=True)
    write(args.out, rows)


def cell(v: dict) -> str:
    return "**0**" if v["max"] == 0 else f"{v['max']:.2g} ({v['mean']:.1g})"


def write(out: Path, rows: list[dict]) -> None:
    stamp = dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"exact_study-{stamp}-cpu1"
    base.with_suffix(".json").write_text(json.dumps(dict(date=stamp, torch=torch.__version__, rows=rows), indent=2))
    lines = [
        f"# Trainer vs server log p ({stamp}, torch {torch.__version__}, CPU, 1 thread, loaded shared machine)",
        "",
        "max |Δ log p| over 252 next tokens (mean in brackets); **0** = bit for bit the server's.",
        "",
        "| dtype | router | " + " | ".join(TRAINERS) + " | exact cost |",
        "|---|---|" + "---|" * len(TRAINERS) + "---|",
        *(
            f"| {r['dtype']} | {r['router']} | "
            + " | ".join(cell(r["trainers"][t]) for t in TRAINERS)
            + f" | {r['exact_cost']:.2f}x |"
            for r in rows
        ),
        "",
    ]
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
