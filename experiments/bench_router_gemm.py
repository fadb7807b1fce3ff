"""The router GEMM of a bf16 model, four ways (``router_dtype``), against the fp64 reference: how
often each gives a token the same top-2 experts, and what each costs (issue 56, item 2).

    PYTHONPATH=.:kernels nice python experiments/bench_router_gemm.py     # about a minute on the shared 2 cores
    python experiments/bench_router_gemm.py --device cuda                 # gpu_check.sh: torch.mm's out_dtype branch

The shape: the router study's baby model (4 blocks, d 128, 8 experts, top-2) in bf16, batch 12 x
64, random weights; the routers' inputs are taken from its forwards (hooks on the gates), 8
batches of byte ids. The forms: ``input`` (bf16 GEMM, bf16 logits), ``bf16`` (the same for a bf16
model), ``fp32`` (activations and weight cast to fp32; the default), ``bf16_fp32`` (bf16 in, fp32
accumulation and logits). The reference: the same bf16 values multiplied and summed in fp64. Speed:
median process CPU time of 200 gate GEMMs [768, 128] x [128, 8] per form, interleaved over 9
rounds, one thread; the machine was shared, so CPU time. On CUDA (``--device cuda``), where
``bf16_fp32`` is one ``torch.mm(..., out_dtype=torch.float32)``, the same figures with the wall time
of the 200 GEMMs between two synchronisations.

Writes ``experiments/results/bench_router_gemm-<date>-<cpu1|cuda>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments.timing import interleaved  # noqa: E402
from moe.agreement import cast_parameters  # noqa: E402
from moe.model import ModelConfig, MoETransformer  # noqa: E402

SHAPE = dict(d_model=128, n_layers=4, n_heads=4, num_experts=8, moe_d_ff=256, max_seq_len=64, vocab_size=256)
FORMS = ("input", "fp32", "bf16_fp32")
K = 2


def router_inputs(model: MoETransformer, batches: int) -> list[torch.Tensor]:
    """Per MoE layer, the bf16 rows its gate saw over ``batches`` forwards."""
    seen: list[list[torch.Tensor]] = [[] for _ in model.routers()]
    hooks = [
        router.gate.register_forward_hook(lambda m, args, out, i=i: seen[i].append(args[0].detach()))
        for i, router in enumerate(model.routers())
    ]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randint(0, SHAPE["vocab_size"], (12, 64), generator=gen).to(next(model.parameters()).device))
    for h in hooks:
        h.remove()
    return [torch.cat(rows) for rows in seen]


def agreement(model: MoETransformer, inputs: list[torch.Tensor]) -> dict:
    """Per form: the share of (token, layer) whose top-2 set equals the fp64 reference's."""
    out = {}
    for form in FORMS:
        same = []
        for router, x_ND in zip(model.routers(), inputs):
            reference = x_ND.double() @ router.gate.weight.double().t()
            router.router_dtype = form
            with torch.no_grad():
                logits = router.score_logits(x_ND)
            want = torch.topk(reference, K).indices.sort(-1).values
            same.append((torch.topk(logits.double(), K).indices.sort(-1).values == want).all(-1))
        out[form] = torch.cat(same).double().mean().item()
    return out


def speed(model: MoETransformer, x_ND: torch.Tensor, rounds: int) -> dict:
    router = model.routers()[0]

    def score(form: str):
        def run() -> None:
            router.router_dtype = form
            with torch.no_grad():
                router.score_logits(x_ND)

        return run

    cuda = x_ND.device.type == "cuda"  # on CUDA the wall time between synchronisations, else CPU time
    sync = torch.cuda.synchronize if cuda else None
    samples = interleaved({f: score(f) for f in FORMS}, rounds, burst=200, sync=sync)
    return {f: samples[f].median("wall" if cuda else "cpu") for f in FORMS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    p.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = cast_parameters(
        MoETransformer(ModelConfig(**SHAPE, router_options={"top_k": K}), init_seed=0), torch.bfloat16
    ).to(args.device)
    inputs = router_inputs(model.eval(), args.batches)
    agree = agreement(model, inputs)
    seconds = speed(model, inputs[0][:768], args.rounds)
    stamp = dt.date.today().isoformat()
    where = "CPU, 1 thread, loaded shared machine" if args.device == "cpu" else torch.cuda.get_device_name()
    rows = [dict(form=f, agreement=agree[f], seconds=seconds[f], vs_fp32=seconds[f] / seconds["fp32"]) for f in FORMS]
    lines = [
        f"# The router GEMM of a bf16 model ({stamp}, torch {torch.__version__}, {where})",
        "",
        f"{inputs[0].shape[0]} tokens x {len(inputs)} layers; top-{K} sets against the fp64 GEMM of the same bf16 values.",
        "",
        "| router_dtype | same top-2 as fp64 | gate GEMM (us) | vs fp32 (the cast) |",
        "|---|---|---|---|",
        *(
            f"| {r['form']} | {100 * r['agreement']:.3f}% | {1e6 * r['seconds']:.1f} | {r['vs_fp32']:.2f}x |"
            for r in rows
        ),
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"bench_router_gemm-{stamp}-{'cpu1' if args.device == 'cpu' else 'cuda'}"
    base.with_suffix(".json").write_text(json.dumps(dict(date=stamp, shape=SHAPE, rows=rows), indent=2))
    base.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
