"""What does packet loss cost data-parallel training? The tiny preset trained on 4 gloo CPU
processes with the gradient reduce-scatter and the parameter broadcast over a simulated lossy
transport (``moe.parallel.lossy``), each aggregation policy at several loss rates, compared
with the reliable run of the same seed (same initialisation, same batches, same packet seed).

    python experiments/packet_loss.py --quick          # reliable, unbiased, naive at 10% and 30%: 0.7 min on 2 quiet cores
    python experiments/packet_loss.py --json experiments/results/packet_loss.json      # the full grid
    python experiments/packet_loss.py --rates 0.1 --policies unbiased naive --seeds 0 1 2 --steps 2000
    python experiments/packet_loss.py --rates --ep-rates 0.1 --seeds 0 1 2 --steps 300 \
        --json experiments/results/packet_loss_ep_p10_300steps.json          # expert-parallel loss only

Per run: the validation loss (teacher-forced, of rank 0's replica) and perplexity; the
perplexity change against the reliable run of the same seed, averaged over seeds with its
standard error (of the per-seed paired differences); and, per step, the gradient-level
figures, which need no long run to be exact: ``grad_rel_error`` (||estimate - mean|| / ||mean||,
the aggregated gradient against the reliable mean of the same local gradients), ``grad_bias``
(<estimate - mean, mean> / ||mean||^2: -0.075 means the step is 7.5% too short along the true
gradient), the delivered packet fraction and the replicas' drift (max and RMS spread).

Expert-parallel runs (``--ep-rates``; ``ep_reliable``, ``ep_drop``, ``ep_renormalise``): the
topk router's experts sharded over the 4 ranks, the token rows of the dispatch and return
exchanges lost at that rate (``moe.parallel.lossy.expert.LossyRouter``: a lost row is a dropped
assignment; ``ep_renormalise`` rescales the surviving combine weights), the rest of the model
data-parallel over a reliable all-reduce; compared with ``ep_reliable`` of the same seed and
evaluated with the exchange reliable.

Writes ``--json`` (``{"runs": [{"loss_rate", "policy", "seeds", "val_loss", "val_ppl",
"ppl_change_pct", "ppl_change_se", "max_drift", "grad_rel_error", "grad_bias", ...}]}``) and a
figure (drift over steps, gradient error and bias per lossy data-parallel configuration) next
to it, and every run's record (final validation loss, per-step figures) as ``.raw.json``, so
``--add-to`` can extend a study with more seeds or rates without rerunning what it holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe.data import load_corpus
from moe.eval import evaluate
from moe.layer import update_routers
from moe.parallel import ExpertParallel, clip_grad_norm_, reduce_gradients, share_router_statistics
from moe.parallel.launch import ok_values, run_local
from moe.parallel.lossy import POLICIES, LossConfig, LossyDataParallel, LossyDPConfig, LossyTransport
from moe.parallel.lossy.expert import wrap_expert_parallel_routers
from moe.training import TrainConfig, build_model, lr_at, model_config
from moe.training.batches import local_batch
from moe.training.distributed import DistInfo, sync_router_state
from moe.training.optim import make_optimizer, set_lr

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4


def train_lossy(cfg: TrainConfig, dp_cfg: LossyDPConfig, corpus, info: DistInfo, eval_windows: int) -> dict:
    """One data-parallel run with :class:`LossyDataParallel` in place of the all-reduce; the
    step is the training loop's (same model, batches, learning-rate schedule, AdamW, router
    updates). Returns the per-step gradient and drift figures and rank 0's final eval."""
    model = build_model(model_config(cfg.model, corpus.vocab_size), cfg.seed, info.device)
    share_router_statistics(model)
    optimizer = make_optimizer(model, cfg.optimizer)
    dp = LossyDataParallel(model, optimizer, dp_cfg)
    keys = ("grad_rel_error", "grad_bias", "received_fraction", "max_drift", "rms_drift")
    history: dict[str, list[float]] = {k: [] for k in keys}
    model.train()
    for step in range(1, cfg.optimizer.steps + 1):
        set_lr(optimizer, lr_at(step - 1, cfg.optimizer))
        idx_BT, targets_BT = local_batch(corpus, cfg.data, cfg.seed, step, info.device, (info.rank, info.world_size))
        out = model(idx_BT, targets_BT)
        optimizer.zero_grad(set_to_none=True)
        (out.loss + out.aux_loss).backward()
        metrics = dp.step(step)
        sync_router_state(model, info)
        update_routers(model)
        for k in keys:
            history[k].append(metrics[k])
    share_router_statistics(model, None)
    ev = evaluate(model, corpus.val, cfg.data.seq_len, eval_windows, device=info.device, causal=False)
    return {"val_loss": ev["teacher_forced_loss"], "history": history}


def train_expert_parallel_lossy(cfg: TrainConfig, loss: LossConfig, renormalise: bool, corpus, info: DistInfo,
                                eval_windows: int) -> dict:
    """One expert-parallel run (experts sharded over the 4 ranks, the rest data-parallel over a
    reliable all-reduce) whose token exchanges lose rows (``LossyRouter``); evaluated with the
    exchange reliable, so the figure is what the loss during training cost."""
    model = build_model(model_config(cfg.model, corpus.vocab_size), cfg.seed, info.device,
                        ExpertParallel(dist.group.WORLD))
    share_router_statistics(model, dist.group.WORLD)
    transport = LossyTransport(loss)
    wrappers = wrap_expert_parallel_routers(model, transport, renormalise)
    optimizer = make_optimizer(model, cfg.optimizer)
    history: dict[str, list[float]] = {"ep_lost_fraction": [], "dropped_fraction": []}
    model.train()
    for step in range(1, cfg.optimizer.steps + 1):
        set_lr(optimizer, lr_at(step - 1, cfg.optimizer))
        idx_BT, targets_BT = local_batch(corpus, cfg.data, cfg.seed, step, info.device, (info.rank, info.world_size))
        transport.begin_step(step)
        out = model(idx_BT, targets_BT)
        optimizer.zero_grad(set_to_none=True)
        (out.loss + out.aux_loss).backward()
        reduce_gradients(model)
        clip_grad_norm_(model, cfg.optimizer.grad_clip)
        optimizer.step()
        sync_router_state(model, info)
        update_routers(model)
        for key in history:
            history[key].append(float(torch.stack([r.stats[key].float() for r in out.routings]).mean()))
    for w in wrappers:
        w.enabled = False
    ev = evaluate(model, corpus.val, cfg.data.seq_len, eval_windows, device=info.device, causal=False)
    share_router_statistics(model, None)
    return {"val_loss": ev["teacher_forced_loss"], "history": history}


def _worker(rank: int, world: int, jobs: list[dict], common: dict) -> list[dict]:
    info = DistInfo(rank, world, 0, torch.device("cpu"))
    corpus = load_corpus("stdlib", max_bytes=common["max_bytes"])
    out = []
    for job in jobs:
        expert = job["policy"].startswith("ep_")
        cfg = TrainConfig.flat(preset=common["preset"], steps=common["steps"], batch_size=common["batch_size"],
                               seq_len=common["seq_len"], seed=job["seed"], warmup_steps=common["warmup_steps"],
                               progress=False, log_every=0, packet_loss=job["loss_rate"],
                               loss_policy="reliable" if expert else job["policy"],
                               loss_packet_size=common["packet_size"], loss_resync_every=common["resync_every"])
        dp_cfg = cfg.lossy.transport(cfg.seed, cfg.optimizer.grad_clip)
        t0 = time.perf_counter()
        if expert:
            res = train_expert_parallel_lossy(cfg, dp_cfg.loss, job["policy"] == "ep_renormalise", corpus, info,
                                              common["eval_windows"])
            detail = f"lost assignments {np.mean(res['history']['ep_lost_fraction']):.4f}"
        else:
            res = train_lossy(cfg, dp_cfg, corpus, info, common["eval_windows"])
            detail = (f"grad rel err {np.mean(res['history']['grad_rel_error']):.4f}, "
                      f"max drift {max(res['history']['max_drift']):.2e}")
        out.append({**job, **res, "wall_s": time.perf_counter() - t0, "config": dataclasses.asdict(cfg)})
        if rank == 0:
            print(f"  {job['policy']:>14} p={job['loss_rate']:.2f} seed {job['seed']}: val loss {res['val_loss']:.4f}, "
                  f"{detail} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return out


def summarise(raw: list[dict]) -> list[dict]:
    """One record per (loss_rate, policy) over its seeds; perplexity change paired by seed with
    the run's baseline (``reliable``; ``ep_reliable`` for the expert-parallel runs)."""
    base = {(r["policy"], r["seed"]): r["val_loss"] for r in raw if r["loss_rate"] == 0.0}
    runs = []
    order = [*POLICIES, "ep_reliable", "ep_drop", "ep_renormalise"]
    keys = sorted(dict.fromkeys((r["loss_rate"], r["policy"]) for r in raw),
                  key=lambda k: (k[1].startswith("ep_"), k[0], order.index(k[1])))
    for rate, policy in keys:
        rs = [r for r in raw if r["loss_rate"] == rate and r["policy"] == policy]
        seeds = [r["seed"] for r in rs]
        baseline = "ep_reliable" if policy.startswith("ep_") else "reliable"
        change = [100 * (math.exp(r["val_loss"] - base[baseline, r["seed"]]) - 1) for r in rs if (baseline, r["seed"]) in base]
        hist = {k: np.asarray([r["history"][k] for r in rs]) for k in rs[0]["history"]}
        val_loss = float(np.mean([r["val_loss"] for r in rs]))
        common = {
            "loss_rate": rate, "policy": policy, "seeds": seeds,
            "val_loss": val_loss, "val_ppl": math.exp(val_loss),
            "val_loss_per_seed": [r["val_loss"] for r in rs],
            "ppl_change_pct": float(np.mean(change)) if change else None,
            "ppl_change_se": float(np.std(change, ddof=1) / math.sqrt(len(change))) if len(change) > 1 else None,
            "wall_s": float(sum(r["wall_s"] for r in rs)),
        }
        if policy.startswith("ep_"):
            runs.append({**common, "ep_lost_fraction": float(hist["ep_lost_fraction"].mean()),
                         "dropped_fraction": float(hist["dropped_fraction"].mean())})
            continue
        runs.append({
            **common,
            "max_drift": float(hist["max_drift"].max()),
            "rms_drift_mean": float(hist["rms_drift"].mean()),
            "grad_rel_error": float(hist["grad_rel_error"].mean()),
            "grad_bias": float(hist["grad_bias"].mean()),
            "grad_bias_se": float(hist["grad_bias"].std(ddof=1) / math.sqrt(hist["grad_bias"].size)),
            "received_fraction": float(hist["received_fraction"].mean()),
            "max_drift_curve": hist["max_drift"].mean(0).tolist(),
        })
    return runs


def table(runs: list[dict]) -> str:
    lines = ["| loss rate | policy | seeds | val loss | val ppl | ppl change % | grad rel error | grad bias | received | max drift |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        change = "" if r["ppl_change_pct"] is None else f"{r['ppl_change_pct']:+.2f}"
        if r["ppl_change_se"] is not None:
            change += f" ± {r['ppl_change_se']:.2f}"
        if r["policy"].startswith("ep_"):
            lines.append(f"| {r['loss_rate']:.2f} | {r['policy']} | {len(r['seeds'])} | {r['val_loss']:.4f} | "
                         f"{r['val_ppl']:.3f} | {change} | | | assignments lost {r['ep_lost_fraction']:.3f} | |")
            continue
        lines.append(f"| {r['loss_rate']:.2f} | {r['policy']} | {len(r['seeds'])} | {r['val_loss']:.4f} | {r['val_ppl']:.3f} | "
                     f"{change} | {r['grad_rel_error']:.4f} | {r['grad_bias']:+.4f} | {r['received_fraction']:.3f} | "
                     f"{r['max_drift']:.2e} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4))
    lossy = [r for r in runs if r["policy"] != "reliable" and not r["policy"].startswith("ep_")]
    for r in lossy:
        ax0.plot(np.arange(1, len(r["max_drift_curve"]) + 1), r["max_drift_curve"], label=f"{r['policy']} p={r['loss_rate']:g}")
    ax0.set(xlabel="step", ylabel="max |replica difference|", yscale="log", title="parameter drift between replicas")
    ax0.legend(fontsize=7)
    x = np.arange(len(lossy))
    ax1.bar(x - 0.2, [r["grad_rel_error"] for r in lossy], 0.4, label="relative error")
    ax1.bar(x + 0.2, [-r["grad_bias"] for r in lossy], 0.4, label="shrinkage (-bias)")
    ax1.set_xticks(x, [f"{r['policy']} p={r['loss_rate']:g}" for r in lossy], fontsize=7, rotation=45, ha="right")
    ax1.set(title="aggregated gradient vs reliable mean (per step, averaged)")
    ax1.legend(fontsize=7)
    for policy in dict.fromkeys(r["policy"] for r in lossy):
        rs = [r for r in lossy if r["policy"] == policy and r["ppl_change_pct"] is not None]
        ax2.errorbar([100 * r["loss_rate"] for r in rs], [r["ppl_change_pct"] for r in rs],
                     yerr=[r["ppl_change_se"] or 0.0 for r in rs], marker="o", capsize=3,
                     label=f"{policy} (seeds: {', '.join(str(len(r['seeds'])) for r in rs)})")
    ax2.axhline(0.0, color="grey", lw=0.8)
    ax2.axhline(0.8, color="red", lw=0.8, ls="--", label="paper: 0.8% at 10% (LLaMA-2 7B, 64 GPUs)")
    ax2.set(xlabel="packet loss rate (%)", ylabel="val perplexity change vs reliable (%)",
            title="perplexity change at equal steps (mean ± SE over seeds)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="40 steps, 1 seed, rates 0.1 and 0.3, policies unbiased and naive, no expert-parallel runs")
    p.add_argument("--rates", type=float, nargs="*", default=[0.01, 0.05, 0.1, 0.2, 0.3],
                   help="data-parallel loss rates (none: no data-parallel runs)")
    p.add_argument("--policies", nargs="+", default=["unbiased", "naive", "reweighted"], choices=[x for x in POLICIES if x != "reliable"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step over the 4 ranks)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--packet-size", type=int, default=256, help="elements per packet (1 KiB of fp32)")
    p.add_argument("--resync-every", type=int, default=0)
    p.add_argument("--ep-rates", type=float, nargs="*", default=[0.1],
                   help="expert-parallel runs (topk, experts over the 4 ranks): lost token rows dropped, or renormalised")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--json", type=Path, help="results JSON; the .md table, .png figure and .raw.json per-run records "
                                             "go next to it (default: experiments/results/packet_loss[_quick].json)")
    p.add_argument("--add-to", action="store_true",
                   help="extend the study at --json: keep its per-run records (.raw.json), run only the (rate, policy, "
                        "seed) jobs it lacks, summarise all together (the settings must match)")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.policies, args.seeds, args.steps, args.eval_windows = [0.1, 0.3], ["unbiased", "naive"], [0], 40, 32
        args.ep_rates = []
    common = {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "warmup_steps": min(30, args.steps // 10), "packet_size": args.packet_size, "resync_every": args.resync_every,
              "eval_windows": args.eval_windows, "max_bytes": 4_000_000}
    jobs = [{"loss_rate": 0.0, "policy": "reliable", "seed": s} for s in args.seeds] if args.rates else []
    jobs += [{"loss_rate": rate, "policy": policy, "seed": s} for rate in args.rates for policy in args.policies for s in args.seeds]
    if args.ep_rates:
        jobs += [{"loss_rate": 0.0, "policy": "ep_reliable", "seed": s} for s in args.seeds]
        jobs += [{"loss_rate": rate, "policy": policy, "seed": s} for rate in args.ep_rates
                 for policy in ("ep_drop", "ep_renormalise") for s in args.seeds]
    json_path = args.json or RESULTS / ("packet_loss_quick.json" if args.quick else "packet_loss.json")
    raw_path = json_path.with_suffix(".raw.json")
    earlier, wall_before = [], 0.0
    if args.add_to:
        if not raw_path.exists():
            p.error(f"--add-to: {raw_path} does not exist (run the study once without --add-to)")
        stored = json.loads(raw_path.read_text())
        if stored["config"] != common:
            p.error(f"--add-to: the stored study ran with {stored['config']}, this one would run with {common}")
        earlier, wall_before = stored["runs"], stored["wall_s"]
        done = {(r["loss_rate"], r["policy"], r["seed"]) for r in earlier}
        jobs = [j for j in jobs if (j["loss_rate"], j["policy"], j["seed"]) not in done]
    print(f"{len(jobs)} runs of {args.steps} steps on {WORLD} gloo processes"
          + (f" (added to {len(earlier)} stored ones)" if args.add_to else ""))
    t0 = time.perf_counter()
    new = ok_values(run_local(_worker, WORLD, jobs, common, timeout_s=24 * 3600.0, pg_timeout_s=600.0))[0] if jobs else []
    wall = wall_before + time.perf_counter() - t0
    raw = earlier + [{**r, "history": {k: [float(f"{v:.5g}") for v in vs] for k, vs in r["history"].items()}} for r in new]
    runs = summarise(raw)
    result = {"date": date.today().isoformat(), "world": WORLD, "wall_s": wall, "config": common,
              "quick": args.quick, "runs": runs}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    raw_path.write_text(json.dumps({"config": common, "wall_s": wall, "runs": raw}) + "\n")
    md = table(runs)
    json_path.with_suffix(".md").write_text(md + "\n")
    if any(r["policy"] not in ("reliable", "ep_reliable", "ep_drop", "ep_renormalise") for r in runs):
        plot(runs, json_path.with_suffix(".png"))  # drift and gradient figures: data-parallel runs only
    print(md)
    print(f"wrote {json_path} (+ .md, .raw.json, and .png when there are lossy data-parallel runs); "
          f"{wall / 60:.1f} min of runs in all")
    return result


if __name__ == "__main__":
    main()
