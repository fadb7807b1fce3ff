"""What does packet loss cost data-parallel training, and does it shrink in the paper's regime
(many workers, large batches)? Runs with the gradient reduce-scatter and the parameter
broadcast over a simulated lossy transport (``moe.parallel.lossy``), each aggregation policy
against the reliable run of the same seed (same initialisation, batches and packet seed).

    python experiments/packet_loss.py --quick     # 4 gloo processes, 40 steps, 10%: 2 min on 2 loaded cores
    # 4 gloo processes through the training loop, the grid of the earlier studies
    python experiments/packet_loss.py --rates 0.1 --policies unbiased naive --seeds 0 1 2 --steps 1000
    # many workers, large batches: logical workers in one process (moe.parallel.lossy.simulated);
    # experiments/results/packet_loss_scaling.*: one process per seed side by side, then merged
    for s in 0 1 2; do python experiments/packet_loss.py --simulate --runs 128:64 32:16 8:4 --rates 0.1 \
        --policies unbiased naive --seeds $s --steps 250 --seq-len 64 --model n_layers=1 --eval-windows 128 \
        --json experiments/results/packet_loss_scaling_parts/seed$s.json & done; wait
    python experiments/packet_loss.py --merge experiments/results/packet_loss_scaling_parts/seed{0,1,2}.raw.json \
        --json experiments/results/packet_loss_scaling.json
    # why the cost grows (docs/studies.md): 8,192 tokens per step split 64 x 2, 16 x 8, 4 x 32; a pretrained
    # start (--pretrain STEPS: train() reliably first); 4x the steps with a validation curve (--eval-every)
    C="--simulate --rates 0.1 --seq-len 64 --eval-windows 128 --model n_layers=1"
    python experiments/packet_loss.py $C --runs 128:64 128:16 128:4 --steps 250 --json experiments/results/packet_loss_split.json
    python experiments/packet_loss.py $C --runs 128:64 --steps 250 --pretrain 2000 --json experiments/results/packet_loss_pretrained.json
    python experiments/packet_loss.py $C --runs 128:4 --policies unbiased --steps 1000 --eval-every 50 \
        --json experiments/results/packet_loss_length.json

``--runs B:P ...``: global batch B (sequences per step; tokens per step = B x seq_len) over P
workers (B / P sequences each). Without ``--simulate`` a run is the training loop itself
(``moe.training.train`` with ``packet_loss``, on P gloo processes; the reliable baseline is its
``loss_policy="reliable"``); with it, P logical workers in one process
(``SimulatedDataParallel``), stepped by the same lossy step and fed by the loop's own pieces
(model, optimizer, learning-rate schedule, batches, evaluation), which at P = 4 gives the
processes' losses to 1e-6 (``tests/test_lossy_simulated.py``).

Per run: the final teacher-forced validation loss (worker 0's replica) and, per step, the
training loss and the gradient-level figures of ``LossyReplicas.step``: ``grad_rel_error``
(||estimate - mean|| / ||mean||: the aggregated gradient against the reliable mean of the same
local gradients), ``grad_bias`` (<estimate - mean, mean> / ||mean||^2), the delivered packet
fraction and the replicas' drift. Per configuration: the perplexity change against the
reliable run of the same seed, the mean of the per-seed paired changes with its standard
error, and the gradient figures averaged over steps, with standard errors over seeds.

Beside the measured error, ``grad_rel_error_predicted`` is what the policy's error should be in
expectation over the loss pattern given the step's gradients, and ``noise_share`` the part of
the mean gradient's square norm that is sampling noise (``moe.parallel.lossy.data_parallel``).

Writes ``--json`` (``{"config", "commands", "runs": [{"workers", "tokens_per_step",
"loss_rate", "policy", "seeds", "ppl_change_pct", "ppl_change_se", "grad_rel_error", ...}]}``),
a markdown table and a figure next to it, and every run's record as ``.raw.json`` after each
run, so an interrupted study keeps what it finished and ``--add-to`` resumes or extends it.

The routers are topk with aux-loss-free balancing (``aux_loss_coef=0``, ``balance_rate``): a
load-balancing loss would count assignments over all ranks in the processes but over each
worker's own batch in the simulator (``moe.parallel.lossy.simulated``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

# experiments/ importable when run as a script; appended, so that PYTHONPATH still chooses the moe it runs
sys.path.append(str(Path(__file__).resolve().parents[1]))
from experiments import rows as runner  # noqa: E402
from experiments.packet_loss_report import HISTORY, compact, run_key, table, write  # noqa: E402
from experiments.timing import Clocks  # noqa: E402
from moe.data import Corpus, load_corpus
from moe.eval import evaluate
from moe.layer import update_routers
from moe.parallel.launch import ok_values, run_local
from moe.parallel.lossy import METRICS, POLICIES, SimulatedDataParallel
from moe.routing import Router
from moe.training import TrainConfig, build_model, lr_at, model_config, train
from moe.training.batches import local_batch
from moe.training.optim import make_optimizer, set_lr

RESULTS = Path(__file__).resolve().parent / "results"
PRETRAINED = Path(__file__).resolve().parents[1] / "runs" / "packet_loss"


def run_config(common: dict, job: dict) -> TrainConfig:
    """The training configuration of one run: the study's settings, the job's batch, seed and
    policy (the reliable baseline is the ``reliable`` policy over the same transport)."""
    return TrainConfig.flat(
        preset=common["preset"],
        model=dict(common["model"]),
        router="topk",
        router_options=dict(common["router_options"]),
        max_bytes=common["max_bytes"],
        seq_len=common["seq_len"],
        batch_size=job["batch_size"],
        steps=common["steps"],
        seed=job["seed"],
        warmup_steps=common["warmup_steps"],
        eval_windows=common["eval_windows"],
        causal_stride=common["seq_len"],
        log_every=0,
        progress=False,
        wandb_mode="disabled",
        packet_loss=job["loss_rate"] or common["baseline_rate"],
        loss_policy=job["policy"],
        loss_packet_size=common["packet_size"],
        loss_resync_every=common["resync_every"],
    )


def simulate(
    cfg: TrainConfig, workers: int, corpus: Corpus, start: dict[str, torch.Tensor] | None = None, eval_every: int = 0
) -> dict:
    """One run of ``workers`` logical workers in this process: the training loop's model,
    optimizer, learning-rate schedule and batches (worker i gets slice i of the global batch,
    as rank i does), the lossy step of ``SimulatedDataParallel``, the routers' buffers averaged
    over the workers before their update. ``start``: a state dict every worker starts from (a
    pretrained model) instead of the seed's initialisation. Returns per-step figures, worker 0's
    final teacher-forced validation loss and, every ``eval_every`` steps, a point of its curve
    (step, validation loss, the largest and the last step's ``max_drift`` since the point before).

    Why not through ``train()``: the loop trains one model with one optimizer per process (its
    placement holds one model, its step strategy is given one optimizer; the loop sets that
    optimizer's learning rate, zeroes its gradients and updates that model's routers), and its
    lossy strategy is one replica per gloo process, which is what the study runs without
    ``--simulate``. P replicas in one process, each with its own optimizer and parameters that
    drift apart, are a step strategy the loop does not have: one that owns the replicas and
    their optimizers. That belongs in the trainer's step layer (``moe/parallel/steps/``, moving
    into ``moe/training/`` as this is written), not in a study; until it exists this loop is
    built from the loop's own pieces, and ``tests/test_lossy_simulated.py`` holds it to the
    4-process ``train()`` run of the same seed (every step's loss within 1e-6)."""
    device = torch.device("cpu")
    model = build_model(model_config(cfg.model, corpus.vocab_size), cfg.seed, device)
    if start is not None:
        model.load_state_dict(start)
    if any(m.aux_loss_coef > 0 for m in model.modules() if isinstance(m, Router)):
        raise ValueError(
            "the simulator counts load-balancing fractions per worker, the processes over all ranks: "
            "use aux_loss_coef=0 (balance_rate balances without that loss)"
        )
    sim = SimulatedDataParallel(
        model,
        lambda m: make_optimizer(m, cfg.optimizer),
        cfg.lossy.transport(cfg.seed, cfg.optimizer.grad_clip),
        workers,
    )
    history: dict[str, list[float]] = {k: [] for k in HISTORY}
    curve: list[dict] = []
    for replica in sim.replicas:
        replica.train()
    for step in range(1, cfg.optimizer.steps + 1):
        lr = lr_at(step - 1, cfg.optimizer)
        loss_sum = 0.0
        for rank, (replica, optimizer) in enumerate(zip(sim.replicas, sim.optimizers)):
            set_lr(optimizer, lr)
            idx_BT, targets_BT = local_batch(corpus, cfg.data, cfg.seed, step, device, (rank, workers))
            optimizer.zero_grad(set_to_none=True)
            out = replica(idx_BT, targets_BT)
            (out.loss + out.aux_loss).backward()
            loss_sum += float(out.loss.detach().double())
        metrics = sim.step(step)
        sim.average_buffers(lambda m: isinstance(m, Router))
        for replica in sim.replicas:
            update_routers(replica)
        history["loss"].append(loss_sum / workers)
        for k in METRICS:
            history[k].append(metrics[k])
        if eval_every and step % eval_every == 0 and step < cfg.optimizer.steps:
            curve.append(_curve_point(sim.replicas[0], corpus, cfg, step, history["max_drift"][-eval_every:]))
    ev = evaluate(sim.replicas[0], corpus.val, cfg.data.seq_len, cfg.eval.eval_windows, device=device, causal=False)
    out = {"val_loss": ev["teacher_forced_loss"], "history": history}
    if eval_every:
        last = cfg.optimizer.steps - (cfg.optimizer.steps - 1) // eval_every * eval_every
        tail = history["max_drift"][-last:]
        out["curve"] = [*curve, _point(cfg.optimizer.steps, ev["teacher_forced_loss"], tail)]
    return out


def _curve_point(model, corpus: Corpus, cfg: TrainConfig, step: int, drifts: list[float]) -> dict:
    ev = evaluate(model, corpus.val, cfg.data.seq_len, cfg.eval.eval_windows, device=torch.device("cpu"), causal=False)
    return _point(step, ev["teacher_forced_loss"], drifts)


def _point(step: int, val_loss: float, drifts: list[float]) -> dict:
    return {"step": step, "val_loss": val_loss, "max_drift": max(drifts), "max_drift_last": drifts[-1]}


def pretrain(common: dict, batch_size: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The pretrained start of ``common["pretrain"]`` (``steps``, ``seed``): ``train()`` run
    reliably on one process with the study's recipe and the runs' global batch (the reliable
    data-parallel step averages the workers' gradients of the same batch: the same update) for
    ``steps`` steps, its own warmup and cosine schedule, evaluated 20 times along the way.
    Returns its final state dict and validation curve; cached under runs/packet_loss/ by config."""
    spec = common["pretrain"]
    fields = dict(
        preset=common["preset"],
        model=dict(common["model"]),
        router="topk",
        router_options=dict(common["router_options"]),
        max_bytes=common["max_bytes"],
        seq_len=common["seq_len"],
        batch_size=batch_size,
        steps=spec["steps"],
        seed=spec["seed"],
        warmup_steps=common["warmup_steps"],
        eval_windows=common["eval_windows"],
        causal_stride=common["seq_len"],
        eval_every=max(1, spec["steps"] // 20),
        log_every=0,
        progress=False,
        wandb_mode="disabled",
    )
    key = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    path = PRETRAINED / f"pretrained-{key}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return saved["state"], saved["curve"]
    res = train(TrainConfig.flat(**fields), load_corpus("stdlib", max_bytes=common["max_bytes"]))
    curve = [
        {"step": r["step"], "val_loss": r["eval/teacher_forced_loss"]}
        for r in res.history
        if "eval/teacher_forced_loss" in r
    ]
    state = {k: v.detach().clone() for k, v in res.model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": state, "curve": curve, "fields": fields}, path)
    return state, curve


def _process_worker(rank: int, world: int, jobs: list[dict], common: dict) -> list[dict]:
    """Each job through the training loop on ``world`` gloo processes (rank 0's records), its
    trained replica evaluated as :func:`simulate` evaluates worker 0's (every position)."""
    corpus = load_corpus("stdlib", max_bytes=common["max_bytes"])
    out = []
    for job in jobs:
        clocks = Clocks()
        cfg = run_config(common, job)
        res = train(cfg, corpus)
        ev = evaluate(
            res.model, corpus.val, cfg.data.seq_len, cfg.eval.eval_windows, device=torch.device("cpu"), causal=False
        )
        history = {k: [r[k] for r in res.history] for k in HISTORY}
        out.append({**job, "val_loss": ev["teacher_forced_loss"], "history": history, "wall_s": clocks.lap()[0]})
    return out


def _parse_runs(values: list[str]) -> list[tuple[int, int]]:
    out = []
    for v in values:
        try:
            batch, workers = (int(x) for x in v.split(":"))
        except ValueError:
            raise SystemExit(f"--runs takes BATCH:WORKERS pairs, got {v!r}") from None
        if workers < 2 or batch % workers:
            raise SystemExit(f"--runs {v}: need at least 2 workers and a batch divisible by them")
        out.append((batch, workers))
    return out


def _overrides(values: list[str]) -> dict:
    """``key=value`` strings as a dict of ints/floats."""
    out = {}
    for v in values:
        key, _, val = v.partition("=")
        out[key] = float(val) if any(c in val for c in ".e") else int(val)
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 steps, seed 0, 10%% loss, unbiased and naive, 4 processes")
    p.add_argument(
        "--runs", nargs="+", default=["16:4"], help="BATCH:WORKERS pairs (global sequences per step : workers)"
    )
    p.add_argument("--simulate", action="store_true", help="logical workers in one process instead of gloo processes")
    p.add_argument("--rates", type=float, nargs="+", default=[0.1], help="packet loss rates")
    p.add_argument(
        "--policies", nargs="+", default=["unbiased", "naive"], choices=[x for x in POLICIES if x != "reliable"]
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", nargs="*", default=[], help="ModelConfig overrides, e.g. n_layers=1 d_model=64")
    p.add_argument("--router-options", nargs="*", default=["aux_loss_coef=0.0", "balance_rate=0.001"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--packet-size", type=int, default=256, help="elements per packet (1 KiB of fp32)")
    p.add_argument("--resync-every", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument(
        "--eval-every", type=int, default=0, help="with --simulate: a validation point every N steps (the curve)"
    )
    p.add_argument(
        "--pretrain",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --simulate: every run starts from a model trained reliably for STEPS steps (0: from scratch)",
    )
    p.add_argument("--pretrain-seed", type=int, default=1000, help="the pretraining's seed (batches, initialisation)")
    p.add_argument(
        "--json",
        type=Path,
        help="results JSON; .md, .png and .raw.json go next to it "
        "(default: experiments/results/packet_loss[_quick].json)",
    )
    p.add_argument(
        "--add-to",
        action="store_true",
        help="keep the runs stored in --json's .raw.json (same settings) and run only the missing ones",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="write --json from these .raw.json files of one study's parts "
        "(same settings, e.g. one seed each, run side by side); runs nothing",
    )
    args = p.parse_args(argv)
    if args.merge:
        if not args.json:
            p.error("--merge needs --json")
        parts = [json.loads(path.read_text()) for path in args.merge]
        if any(part["config"] != parts[0]["config"] for part in parts):
            p.error("--merge: the parts ran with different settings")
        # a run stored twice (a part rerun with more figures): the later part's record
        raw = runner.merge(*(part["runs"] for part in parts), key=run_key)
        commands = [c for part in parts for c in part["commands"]] + [
            runner.command("experiments/packet_loss.py", argv)
        ]
        wall = sum(part["wall_s"] for part in parts)
        runs = write(args.json, parts[0]["config"], commands, raw, wall, True, parts[0].get("pretrained_curves"))
        print(table(runs))
        return {"config": parts[0]["config"], "runs": runs}
    if args.quick:
        args.runs, args.simulate, args.seeds, args.steps, args.eval_windows = ["16:4"], False, [0], 40, 32
    if (args.eval_every or args.pretrain) and not args.simulate:
        p.error("--eval-every and --pretrain need --simulate")
    common = {
        "preset": args.preset,
        "model": _overrides(args.model),
        "router_options": _overrides(args.router_options),
        "steps": args.steps,
        "seq_len": args.seq_len,
        "warmup_steps": min(30, args.steps // 10),
        "packet_size": args.packet_size,
        "resync_every": args.resync_every,
        "eval_windows": args.eval_windows,
        "max_bytes": 4_000_000,
        "baseline_rate": max(args.rates),
        "simulated": args.simulate,
    }
    # only when asked for, so that the settings of the studies before them still compare equal
    if args.eval_every:
        common["eval_every"] = args.eval_every
    if args.pretrain:
        common["pretrain"] = {"steps": args.pretrain, "seed": args.pretrain_seed}
    corpus = load_corpus("stdlib", max_bytes=common["max_bytes"])
    common["model_config"] = asdict(
        model_config(
            run_config(common, {"batch_size": 2, "seed": 0, "loss_rate": 0.1, "policy": "unbiased"}).model,
            corpus.vocab_size,
        )
    )
    jobs = [
        {
            "batch_size": b,
            "workers": w,
            "tokens_per_step": b * args.seq_len,
            "loss_rate": rate,
            "policy": policy,
            "seed": s,
        }
        for s in args.seeds
        for b, w in _parse_runs(args.runs)
        for rate, policy in [(0.0, "reliable"), *[(r, q) for r in args.rates for q in args.policies]]
    ]
    jobs = list({tuple(j.items()): j for j in jobs}.values())
    json_path = args.json or RESULTS / ("packet_loss_quick.json" if args.quick else "packet_loss.json")
    ran = runner.provenance(runner.command("experiments/packet_loss.py", argv))
    raw, wall, commands, pretrained = [], 0.0, [ran["command"]], {}
    stamp = {k: ran[k] for k in ("commit", "machine", "command", "date")}  # each run's provenance
    if args.add_to:
        raw_path = json_path.with_suffix(".raw.json")
        if not raw_path.exists():
            p.error(f"--add-to: {raw_path} does not exist (run the study once without --add-to)")
        stored = json.loads(raw_path.read_text())
        if stored["config"] != common:
            p.error(f"--add-to: the stored study ran with {stored['config']}, this one would run with {common}")
        raw, wall, commands = stored["runs"], stored["wall_s"], [*stored["commands"], ran["command"]]
        pretrained = stored.get("pretrained_curves", {})
        jobs = runner.pending(jobs, raw, key=run_key)
    print(
        f"{len(jobs)} runs of {args.steps} steps ({'logical workers in one process' if args.simulate else 'gloo processes'})",
        flush=True,
    )
    if args.simulate:
        starts = {}
        for b in dict.fromkeys(j["batch_size"] for j in jobs) if args.pretrain else ():
            clocks = Clocks()
            starts[b], pretrained[str(b)] = pretrain(common, b)
            print(
                f"  pretrained start, batch {b}: val loss {pretrained[str(b)][-1]['val_loss']:.4f} "
                f"after {args.pretrain} steps ({clocks.lap()[0]:.0f}s)",
                flush=True,
            )

        def run_job(job: dict) -> dict:
            clocks = Clocks()
            res = simulate(
                run_config(common, job), job["workers"], corpus, starts.get(job["batch_size"]), args.eval_every
            )
            return {**job, **compact(res), "wall_s": clocks.lap()[0], **stamp}

        def store(run: dict) -> None:
            nonlocal wall
            raw.append(run)
            wall += run["wall_s"]
            print(
                f"  {run['tokens_per_step']:>6} tok/step P={run['workers']:<3} {run['policy']:>9} p={run['loss_rate']:.2f} "
                f"seed {run['seed']}: val loss {run['val_loss']:.4f}, grad rel err "
                f"{np.mean(run['history']['grad_rel_error']):.4f} ({run['wall_s']:.0f}s)",
                flush=True,
            )
            write(json_path, common, commands, raw, wall, False, pretrained)

        runner.run_rows(run_job, jobs, 0, store)
    for workers in dict.fromkeys(j["workers"] for j in jobs if not args.simulate):
        clocks = Clocks()
        mine = [j for j in jobs if j["workers"] == workers]
        raw += [
            {**compact(r), **stamp}
            for r in ok_values(
                run_local(_process_worker, workers, mine, common, timeout_s=24 * 3600.0, pg_timeout_s=600.0)
            )[0]
        ]
        wall += clocks.lap()[0]
        write(json_path, common, commands, raw, wall, False, pretrained)
    runs = write(json_path, common, commands, raw, wall, True, pretrained)
    print(table(runs))
    print(f"wrote {json_path} (+ .md, .png, .raw.json); {wall / 60:.1f} min of runs in all")
    return {"config": common, "runs": runs}


if __name__ == "__main__":
    main()
