"""The training loop used by the experiments: AdamW, warmup + cosine decay, gradient clipping,
bf16 autocast on CUDA (fp32 on CPU), periodic teacher-forced and causal evaluation, atomic
checkpoints with exact resume, a metrics JSONL, and wandb on rank 0.

Launched by ``experiments/train.py`` (single process or ``torchrun`` data parallel):

    python experiments/train.py --preset tiny --router topk --steps 300
    torchrun --nproc_per_node 2 experiments/train.py --preset tiny --router topk --batch-size 16
    torchrun --standalone --nproc-per-node 2 experiments/train.py --preset tiny --expert-parallel 2

Data parallel: ``--batch-size`` is global. Every rank draws the same global batch of step s
from (seed, s) and keeps its own contiguous slice, so the union over ranks is the
single-process batch; gradients (and the router statistics that ``update_after_step`` folds
in) are averaged over ranks before they are used. Logging, wandb and checkpoints happen on
rank 0 only; every rank evaluates (the same windows), so a sharded model can join in.

On more than one process the model lives on a DeviceMesh (``moe.parallel.mesh``) built from
``--pipeline-parallel Q --dp-replicate R --expert-parallel P``: the blocks cut into Q pipeline
stages (``moe.training.pipeline``; a rank then holds one stage and its data-parallel share of
the batch flows through the stages in ``--microbatches M`` microbatches), and within a stage
dense weights FSDP2-sharded over the stage's data-parallel ranks (HSDP when R > 1), experts
split over P expert-parallel ranks and FSDP2-sharded over what remains, gradients reduced by
FSDP2. The model is built whole from the seed and then cut and sharded, so initialisation,
batches and (with the routers counting load-balancing fractions over all data-parallel ranks)
every step's loss match the single-process run to fp32 rounding. Clipping uses the whole
model's norm. ``--microbatches M`` alone accumulates the gradients of M microbatches.

Shape legend: B batch (local to a rank unless named global), T sequence, V vocabulary,
E experts, L MoE layers, W evaluation windows, P evaluated positions per window.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from moe.data import Corpus, batch_offsets, load_corpus, windows
from moe.eval import autocast, evaluate
from moe.layer import update_routers
from moe.model import ModelConfig, MoETransformer, preset
from moe.parallel import clip_grad_norm_, load_full_state_dict, share_router_statistics
from moe.parallel.lossy import LossyDataParallel
from moe.parallel.mesh import Layout, ParallelMesh
from moe.parallel.reduce_precision import MeasuredReduceScatter
from moe.routing import Router
from moe.training.checkpoint import (
    EXPORT_NAME,
    complete_checkpoints,
    export_model,
    load_checkpoint,
    save_checkpoint,
    truncate_jsonl,
)
from moe.training.config import REDUCE_DTYPES, TrainConfig
from moe.training.distributed import DistInfo, inject_fault, setup_distributed, sync_router_state
from moe.training.metrics import RouterEntropy, StepTally, init_wandb, wandb_flat
from moe.training.pipeline import sync_tied_gradient
from moe.training.placement import place_model


LOSSY_METRICS = ("received_fraction", "grad_rel_error", "grad_bias", "max_drift", "rms_drift")
"""Per-step figures of ``--packet-loss`` runs written to the metrics (see ``LossyDataParallel.step``)."""


@dataclass
class TrainResult:
    """What :func:`train` returns (on every rank)."""

    model: nn.Module
    """The trained model: a MoETransformer (sharded on more than one process), or this rank's
    :class:`~moe.training.pipeline.StageModel` under pipeline parallelism."""
    optimizer: torch.optim.Optimizer
    model_config: ModelConfig
    history: list[dict]
    """The per-step metric records (rank 0; empty elsewhere), as written to the metrics JSONL."""
    final_eval: dict
    """Evaluation after the last step: teacher_forced_loss, causal_loss, leakage_gap, ..."""
    train_time_s: float
    """Wall time of the optimizer steps of this invocation (evaluation excluded)."""


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset with the run's router, vocabulary and overrides (max_seq_len grows to seq_len).
    Router options follow ``moe.model.preset``'s rule: the preset's carry over only to the
    preset's own router, and the run's are merged on top. A ``d_ff`` override on a model
    without dense blocks is refused: it would change nothing (the expert width is ``moe_d_ff``)."""
    overrides = dict(cfg.model)
    overrides.setdefault("max_seq_len", max(preset(cfg.preset).max_seq_len, cfg.seq_len))
    mcfg = preset(cfg.preset, vocab_size=vocab_size, router=cfg.router, router_options=dict(cfg.router_options),
                  **overrides)
    if "d_ff" in cfg.model and not mcfg.uses_d_ff():
        raise ValueError(f"d_ff={cfg.model['d_ff']} has no effect: every block is an MoE block (moe_every="
                         f"{mcfg.moe_every}); the expert width is moe_d_ff (--moe-d-ff), or make some blocks dense "
                         "with --moe-every N > 1")
    return mcfg


def build_model(mcfg: ModelConfig, seed: int, device: torch.device, expert_parallel=None) -> MoETransformer:
    """The model, initialised from ``seed`` (identically on every rank) and moved to ``device``.
    With ``expert_parallel`` (a ``moe.parallel.ExpertParallel``) the full model is built and
    this rank's expert shard cut from it, so the initialisation is the single-process one
    whatever the number of processes."""
    torch.manual_seed(seed)
    model = MoETransformer(mcfg)
    if expert_parallel is not None:
        full, model = model, MoETransformer(mcfg, expert_parallel=expert_parallel)
        load_full_state_dict(model, full.state_dict())
    return model.to(device)


def local_batch(corpus: Corpus, cfg: TrainConfig, step: int, info: DistInfo,
                data_parallel: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """(idx_BT, targets_BT) of this rank: its contiguous slice of the global batch of ``step``;
    ``data_parallel`` = (rank, size) among the data-parallel ranks (default: every process is
    one: (rank, world size))."""
    rank, size = data_parallel or (info.rank, info.world_size)
    if cfg.batch_size % size:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by {size} data-parallel ranks")
    b = cfg.batch_size // size
    offsets_B = batch_offsets(corpus.train.numel(), cfg.seq_len, cfg.batch_size, cfg.seed, step)
    idx_BT, targets_BT = windows(corpus.train, offsets_B[rank * b : (rank + 1) * b], cfg.seq_len)
    return idx_BT.to(info.device), targets_BT.to(info.device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine decay to
    ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def train(cfg: TrainConfig, corpus: Corpus | None = None) -> TrainResult:
    """Train one model as ``cfg`` says (see the module docstring for the distributed contract)."""
    info = setup_distributed(cfg.device, cfg.collective_timeout_s)
    try:
        return _train(cfg, corpus, info)
    finally:
        if info.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, corpus: Corpus | None, info: DistInfo) -> TrainResult:
    if corpus is None:
        corpus = load_corpus(cfg.data, cfg.val_fraction, cfg.max_bytes, cfg.canary_vocab)
    mcfg = model_config(cfg, corpus.vocab_size)
    layout = Layout.from_world(info.world_size, cfg.dp_replicate, cfg.expert_parallel, cfg.pipeline_parallel)
    lossy = cfg.packet_loss > 0
    if lossy and info.world_size == 1:
        raise ValueError("--packet-loss simulates data parallelism over a lossy network: launch at least 2 "
                         "processes (torchrun --nproc-per-node N)")
    pmesh = ParallelMesh(layout, info.device.type) if info.world_size > 1 and not lossy else None
    if cfg.hf_model:
        if pmesh is not None:
            raise ValueError("--hf-model runs on one process (sharding a transformers model is not supported yet)")
        from moe.integrations.hf import build_hf_model  # the [hf] extra, imported only when asked for

        model = build_hf_model(cfg.hf_model, cfg.router, cfg.router_options, corpus.vocab_size, cfg.seed,
                               mcfg.backend).to(info.device)
    else:
        layout.check_experts(mcfg.num_experts)
        model = build_model(mcfg, cfg.seed, info.device, pmesh.expert_parallel() if pmesh is not None else None)
    num_params = model.num_parameters()
    place = place_model(model, cfg, info, layout, pmesh)
    model, stage, pipe = place.model, place.stage, place.pipe
    routers = [m for m in model.modules() if isinstance(m, Router)]
    num_moe_layers = stage.num_moe_layers if stage is not None else len(routers)
    num_experts = routers[0].num_experts if routers else mcfg.num_experts
    low_reduce = None
    if place.sharded and cfg.grad_reduce_dtype != "fp32":  # applied, and measured against fp32
        low_reduce = MeasuredReduceScatter(REDUCE_DTYPES[cfg.grad_reduce_dtype])
        low_reduce.install(model)
    optimizer = make_optimizer(model, cfg)
    lossy_dp = LossyDataParallel(model, optimizer, cfg.lossy_data_parallel()) if lossy else None
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    found = complete_checkpoints(ckpt_dir) if cfg.resume else []
    start, run_id = load_checkpoint(found[-1], model, optimizer, mcfg) if found else (0, None)
    jsonl = Path(cfg.metrics_jsonl) if cfg.metrics_jsonl and info.is_main else None
    if jsonl is not None:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        if start:
            truncate_jsonl(jsonl, start)
        else:
            jsonl.write_text("")
    run = init_wandb(cfg, mcfg, info, run_id)
    if info.is_main and cfg.log_every:
        tqdm.write(f"data: {corpus.source}; {corpus.train.numel():,} train / {corpus.val.numel():,} val tokens; "
                   f"model: {num_params:,} parameters, router {cfg.router} {cfg.router_options}")
    def run_eval() -> dict:
        return evaluate(place.eval_model, corpus.val, cfg.seq_len, cfg.eval_windows, cfg.causal_stride, cfg.eval_batch_size,
                        info.device)

    entropy = RouterEntropy(model)
    history: list[dict] = []
    final_eval: dict = {}
    train_time = 0.0
    model.train()
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=f"train {cfg.router}",
               disable=not (info.is_main and cfg.progress), dynamic_ncols=True)
    for step in bar:
        inject_fault(step, info)
        t0 = time.perf_counter()
        lr = lr_at(step - 1, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx_BT, targets_BT = local_batch(corpus, cfg, step, info, (place.dp_rank, place.dp_size))
        entropy.pop()
        optimizer.zero_grad(set_to_none=True)
        tally = StepTally(num_moe_layers, num_experts, info.device)
        if pipe is not None:  # the schedule runs every microbatch's forward and backward
            with autocast(info.device):
                for loss_m in pipe.step(idx_BT, targets_BT):
                    tally.add_loss(loss_m)
            tally.add_microbatches(cfg.microbatches)
            for rec in stage.pop_records():
                tally.add_routing(rec.layer, rec.aux_loss, rec.dropped_fraction, rec.tokens_per_expert)
            sync_tied_gradient(stage.tied_weight(), place.tied_group)
        else:
            for m, (idx_bT, targets_bT) in enumerate(zip(idx_BT.chunk(cfg.microbatches), targets_BT.chunk(cfg.microbatches))):
                if place.sharded and cfg.microbatches > 1:  # reduce-scatter once, after the last microbatch
                    model.set_requires_gradient_sync(m == cfg.microbatches - 1)
                with autocast(info.device):
                    out = model(idx_bT, targets_bT)
                loss = out.loss + out.aux_loss
                (loss / cfg.microbatches if cfg.microbatches > 1 else loss).backward()
                tally.add_output(out)
        if lossy_dp is not None:  # aggregate over the lossy transport, owners update, broadcast
            lossy_info = lossy_dp.step(step)
            grad_norm = lossy_info["grad_norm"]
            reduce_info = {k: lossy_info[k] for k in LOSSY_METRICS}
        else:
            reduce_info = low_reduce.pop(info.device) if low_reduce is not None else {}
            grad_norm = clip_grad_norm_(model, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"), place.pp_group,
                                        place.uncounted())
            optimizer.step()
        sync_router_state(model, info, place.dp_group)
        update_routers(model)
        record = {"step": step, **tally.finish(entropy.pop(), layout.pipeline)}
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        dt = time.perf_counter() - t0
        train_time += dt
        record.update(lr=lr, grad_norm=float(grad_norm), tokens_per_s=cfg.batch_size * cfg.seq_len / dt, **reduce_info)
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            ev = run_eval()
            record.update({f"eval/{k}": v for k, v in ev.items()})
            if step == cfg.steps:
                final_eval = ev
        if info.is_main:
            history.append(record)
            if jsonl is not None:
                with jsonl.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            if run is not None:
                run.log(wandb_flat(record), step=step)
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps):
                line = (f"step {step:5d} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f} | lr {lr:.2e} | "
                        f"dropped {record['dropped_fraction']:.3f} | {record['tokens_per_s']:,.0f} tok/s")
                if "eval/causal_loss" in record:
                    line += (f" | eval tf {record['eval/teacher_forced_loss']:.4f} causal "
                             f"{record['eval/causal_loss']:.4f} gap {record['eval/leakage_gap']:+.4f}")
                tqdm.write(line)
        if ckpt_dir is not None and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            save_checkpoint(ckpt_dir, model, optimizer, step, cfg, mcfg, info, cfg.keep_checkpoints,
                            run.id if run is not None else None)
    bar.close()
    if cfg.export_model:
        export_model(ckpt_dir / EXPORT_NAME, model, mcfg, info, place.pp_group)
    entropy.close()
    if not final_eval:
        final_eval = run_eval()
    if run is not None:
        run.summary.update({f"final/{k}": v for k, v in final_eval.items()})
        run.finish()
    if place.dp_size > 1:
        share_router_statistics(model, None)  # the returned model's routers count locally again
        dist.barrier()  # no rank tears the group down while rank 0 still writes its checkpoint
    return TrainResult(model, optimizer, mcfg, history, final_eval, train_time)
