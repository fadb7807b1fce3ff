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

Expert parallel (``--expert-parallel N``, N = world size): every MoE block's experts are
sharded over the N ranks (``moe.parallel``); everything else stays data-parallel. The model
is built whole from the seed and each rank keeps its shard, so initialisation, batches and
(with the routers counting load-balancing fractions over all ranks) every step's loss match
the single-process run to fp32 rounding. Replicated gradients are averaged, expert gradients
only scaled by 1/N (they already hold every rank's tokens), clipping uses the whole model's
norm, and checkpoints are gathered into a single-process checkpoint, loadable on any N.

Shape legend: B batch (local to a rank unless named global), T sequence, V vocabulary,
E experts, L MoE layers, W evaluation windows, P evaluated positions per window.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import textwrap
import time
import types
import typing
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from moe.data import Corpus, batch_offsets, eval_offsets, load_corpus, windows
from moe.layer import update_routers
from moe.model import ModelConfig, ModelOutput, MoETransformer, preset
from moe.parallel import (
    clip_grad_norm_,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    share_router_statistics,
)
from moe.parallel import reduce_gradients as reduce_parallel_gradients
from moe.routing import Router

CHECKPOINT_NAME = "ckpt.pt"
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TrainConfig:
    """Everything one training run needs; validated on construction. ``experiments/train.py``
    turns every field into a command-line flag (``seq_len`` -> ``--seq-len``)."""

    preset: str = "tiny"
    """Model preset (``moe.model.PRESETS``)."""
    router: str = "topk"
    """Router name (``moe.list_routers()``)."""
    router_options: dict = field(default_factory=dict)
    """Router options, e.g. ``{"top_k": 2}``; on the command line ``--router-option top_k=2``."""
    model: dict = field(default_factory=dict)
    """Overrides of the preset's ModelConfig fields; on the command line ``--d-model 128``."""
    data: str = "stdlib"
    """Corpus: "stdlib" (the Python standard library's source), "canary" (uniform random tokens) or a path."""
    val_fraction: float = 0.1
    """Fraction of the token stream held out for validation (the end of each of 20 segments)."""
    max_bytes: int = 4_000_000
    """Tokens read from the corpus (for the canary: tokens drawn)."""
    canary_vocab: int = 8
    """Vocabulary of the canary corpus."""
    seq_len: int = 128
    """T: training and evaluation sequence length."""
    batch_size: int = 16
    """Global batch size (sequences per optimizer step, summed over data-parallel ranks)."""
    steps: int = 300
    """Optimizer steps."""
    seed: int = 0
    """Seeds the model initialisation and the batches (batch of step s is a function of (seed, s))."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of ``lr``."""
    warmup_steps: int = 30
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only; norms are not decayed)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only after the last step)."""
    eval_windows: int = 32
    """W: validation windows of ``seq_len`` tokens evaluated (W * T positions teacher-forced)."""
    eval_batch_size: int = 64
    """Windows per evaluation forward (routers grouped over the batch see this many sequences)."""
    causal_stride: int = 1
    """Causal loss at positions t = k-1, 2k-1, ... (every k-th); 1 = every position."""
    log_every: int = 10
    """Print a log line every N steps (0 = never); the metrics JSONL gets every step."""
    metrics_jsonl: str | None = None
    """Write one JSON object per step here (rank 0)."""
    checkpoint_dir: str | None = None
    """Write ``ckpt.pt`` here (atomically) every ``checkpoint_every`` steps and after the last step."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only after the last step)."""
    resume: bool = False
    """Continue from ``checkpoint_dir/ckpt.pt`` if it exists."""
    wandb_project: str = "causal-moe-routing"
    """wandb project."""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's own)."""
    wandb_mode: str | None = None
    """online | offline | disabled; default: $WANDB_MODE, else online iff $WANDB_API_KEY is set, else offline."""
    wandb_dir: str | None = None
    """Directory for wandb's files (default: ``checkpoint_dir``, else the current directory)."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda, cuda:N."""
    expert_parallel: int = 1
    """Expert-parallel group size: 1 = experts replicated; N = the world size (torchrun
    --nproc-per-node N): experts sharded over all N ranks (``moe.parallel``), the rest data-parallel."""
    grad_reduce_dtype: str = "fp32"
    """Precision of the data-parallel gradient all-reduce: fp32, or bf16 to measure the bias low
    precision adds (bf16 is applied; its difference from fp32 on the same step is logged as
    grad_reduce_rel_diff and grad_reduce_max_abs_diff)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""

    def __post_init__(self) -> None:
        positive = ("max_bytes", "seq_len", "batch_size", "steps", "eval_windows", "eval_batch_size", "causal_stride",
                    "expert_parallel", "canary_vocab")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "eval_every", "log_every", "checkpoint_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 0, got {v!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got lr={self.lr}, min_lr_ratio={self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip < 0 or not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("need weight_decay >= 0, grad_clip >= 0 and betas in [0, 1)")
        if self.causal_stride > self.seq_len:
            raise ValueError(f"causal_stride={self.causal_stride} exceeds seq_len={self.seq_len}")
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"wandb_mode must be online, offline or disabled, got {self.wandb_mode!r}")
        if self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {self.grad_reduce_dtype!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir")
        model_fields = {f.name for f in fields(ModelConfig)} - {"vocab_size", "router", "router_options"}
        bad = set(self.model) - model_fields
        if bad:
            raise ValueError(f"unknown model overrides {sorted(bad)}; known: {sorted(model_fields)}")


@dataclass
class TrainResult:
    """What :func:`train` returns (on every rank)."""

    model: MoETransformer
    model_config: ModelConfig
    history: list[dict]
    """The per-step metric records (rank 0; empty elsewhere), as written to the metrics JSONL."""
    final_eval: dict
    """Evaluation after the last step: teacher_forced_loss, causal_loss, leakage_gap, ..."""
    train_time_s: float
    """Wall time of the optimizer steps of this invocation (evaluation excluded)."""


# -- distributed --------------------------------------------------------------------------
@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False
    """True when :func:`setup_distributed` created the process group (and must destroy it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str = "auto") -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; join the process group (gloo on CPU,
    NCCL on CUDA) when WORLD_SIZE > 1 and none exists; pick the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, dev, owns)


def check_expert_parallel(cfg: TrainConfig, info: DistInfo) -> None:
    """``--expert-parallel N`` shards the experts over every rank: N must be the world size."""
    if cfg.expert_parallel not in (1, info.world_size):
        raise ValueError(
            f"--expert-parallel {cfg.expert_parallel} must equal the number of processes ({info.world_size}): "
            f"launch with torchrun --nproc-per-node {cfg.expert_parallel}"
        )


# -- the pieces a parallel scheme replaces ------------------------------------------------
def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset with the run's router, vocabulary and overrides (max_seq_len grows to seq_len)."""
    overrides = dict(cfg.model)
    overrides.setdefault("max_seq_len", max(preset(cfg.preset).max_seq_len, cfg.seq_len))
    return preset(cfg.preset, vocab_size=vocab_size, router=cfg.router, router_options=dict(cfg.router_options), **overrides)


def build_model(mcfg: ModelConfig, seed: int, device: torch.device, ep_group=None) -> MoETransformer:
    """The model, initialised from ``seed`` (identically on every rank) and moved to ``device``.
    With ``ep_group`` the full model is built and this rank's expert shard cut from it, so the
    initialisation is the single-process one whatever the number of processes."""
    torch.manual_seed(seed)
    model = MoETransformer(mcfg)
    if ep_group is not None:
        full, model = model, MoETransformer(mcfg, ep_group=ep_group)
        load_full_state_dict(model, full.state_dict())
    return model.to(device)


def local_batch(corpus: Corpus, cfg: TrainConfig, step: int, info: DistInfo) -> tuple[Tensor, Tensor]:
    """(idx_BT, targets_BT) of this rank: its contiguous slice of the global batch of ``step``."""
    if cfg.batch_size % info.world_size:
        raise ValueError(f"global batch_size={cfg.batch_size} is not divisible by world size {info.world_size}")
    b = cfg.batch_size // info.world_size
    offsets_B = batch_offsets(corpus.train.numel(), cfg.seq_len, cfg.batch_size, cfg.seed, step)
    idx_BT, targets_BT = windows(corpus.train, offsets_B[info.rank * b : (info.rank + 1) * b], cfg.seq_len)
    return idx_BT.to(info.device), targets_BT.to(info.device)


def reduce_gradients(model: nn.Module, info: DistInfo, reduce_dtype: str = "fp32") -> dict:
    """Make every gradient that of the global batch's loss: replicated parameters averaged over
    the ranks (one flat all-reduce), sharded expert parameters scaled by 1/world size (see
    ``moe.parallel.reduce_gradients``). Returns the bf16-vs-fp32 difference for "bf16"."""
    if info.world_size == 1:
        return {}
    return reduce_parallel_gradients(model, reduce_dtype=REDUCE_DTYPES[reduce_dtype])


def sync_router_state(model: nn.Module, info: DistInfo) -> None:
    """Average the routers' floating buffers over ranks before ``update_routers``.

    Router buffers are either identical on every rank (balancing biases, threshold averages:
    averaging keeps them) or statistics of the local batch (loads seen, pending cut-offs:
    averaging gives the global batch's statistic up to a common scale that the routers'
    updates do not depend on), so every rank folds in the same global-batch update.
    """
    if info.world_size == 1:
        return
    for m in model.modules():
        if isinstance(m, Router):
            for buf in m.buffers(recurse=False):
                if buf.is_floating_point():
                    dist.all_reduce(buf)
                    buf /= info.world_size


# -- optimisation -------------------------------------------------------------------------
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


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing (fp32) elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


# -- evaluation ---------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: MoETransformer,
    val_tokens: Tensor,
    seq_len: int,
    num_windows: int,
    causal_stride: int = 1,
    batch_size: int = 64,
    device: torch.device | None = None,
    causal: bool = True,
    with_train_mode: bool = False,
) -> dict:
    """Teacher-forced and causal loss (eval mode) on the same validation positions.

    W evenly spaced windows of T tokens; evaluated positions t = k-1, 2k-1, ... (k =
    ``causal_stride``). Teacher-forced: one full-window forward, the loss read at those
    positions. Causal: for each evaluated t, a forward of the prefix 0..t alone (the windows
    of a chunk batched together, as batched decoding would run them), the loss of its last
    position. Returns ``teacher_forced_loss``, ``causal_loss``, ``leakage_gap`` (causal minus
    teacher-forced) with its standard error ``leakage_gap_se`` (over positions),
    ``teacher_forced_loss_all`` (every position) and ``eval_positions``.

    ``causal=False`` skips the prefix forwards (only the teacher-forced keys are returned).
    ``with_train_mode`` adds ``train_mode_loss``: the teacher-forced loss with training-mode
    routing, which is what the training curve reports. Routers that learn from batches record
    statistics in training mode, so ask for it only when training is over.
    """
    device = device or next(model.parameters()).device
    was_training = model.training
    idx_WT, targets_WT = windows(val_tokens, eval_offsets(val_tokens.numel(), seq_len, num_windows), seq_len)
    pos_P = torch.arange(causal_stride - 1, seq_len, causal_stride)

    def nll(idx_BT: Tensor, targets_BT: Tensor) -> Tensor:
        with autocast(device):
            logits_BTV = model(idx_BT).logits
        return F.cross_entropy(logits_BTV.float().transpose(1, 2), targets_BT, reduction="none").double().cpu()

    tf_WT, causal_WP, train_WT = [], [], []
    for start in range(0, num_windows, batch_size):
        idx_BT = idx_WT[start : start + batch_size].to(device)
        targets_BT = targets_WT[start : start + batch_size].to(device)
        model.eval()
        tf_WT.append(nll(idx_BT, targets_BT))
        if causal:
            causal_WP.append(torch.cat([nll(idx_BT[:, : t + 1], targets_BT[:, : t + 1])[:, -1:] for t in pos_P.tolist()], 1))
        if with_train_mode:
            model.train()
            train_WT.append(nll(idx_BT, targets_BT))
    model.train(was_training)
    tf_WT = torch.cat(tf_WT)
    out = {
        "teacher_forced_loss": tf_WT[:, pos_P].mean().item(),
        "teacher_forced_loss_all": tf_WT.mean().item(),
        "eval_positions": num_windows * pos_P.numel(),
    }
    if causal:
        causal_WP = torch.cat(causal_WP)
        diff_WP = causal_WP - tf_WT[:, pos_P]
        out["causal_loss"] = causal_WP.mean().item()
        out["leakage_gap"] = diff_WP.mean().item()
        out["leakage_gap_se"] = (diff_WP.std() / math.sqrt(diff_WP.numel())).item() if diff_WP.numel() > 1 else 0.0
    if with_train_mode:
        out["train_mode_loss"] = torch.cat(train_WT)[:, pos_P].mean().item()
    return out


# -- metrics ------------------------------------------------------------------------------
class RouterEntropy:
    """Mean per-token entropy (nats) of each router's softmax over experts, caught by forward
    hooks on the router gates; :meth:`pop` returns the mean since the last call."""

    def __init__(self, model: nn.Module) -> None:
        self.values: list[Tensor] = []
        self.handles = [m.gate.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, module: nn.Module, inputs: tuple, logits_NE: Tensor) -> None:
        logp_NE = logits_NE.detach().float().log_softmax(-1)
        self.values.append(-(logp_NE.exp() * logp_NE).sum(-1).mean())

    def pop(self) -> Tensor:
        out = torch.stack(self.values).mean() if self.values else torch.zeros(())
        self.values.clear()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def step_metrics(out: ModelOutput, entropy: Tensor, info: DistInfo) -> dict:
    """Loss, aux loss, dropped fraction, router entropy (averaged over ranks) and per-layer
    expert loads (summed over ranks) of one training step."""
    dev = out.loss.device
    scalars = torch.stack([
        out.loss.detach().float(),
        out.aux_loss.detach().float(),
        torch.stack([r.stats["dropped_fraction"].float().to(dev) for r in out.routings]).mean()
        if out.routings else torch.zeros((), device=dev),
        entropy.to(dev),
    ])
    tokens_LE = (torch.stack([r.stats["tokens_per_expert"].to(dev) for r in out.routings])
                 if out.routings else torch.zeros(0, 0, dtype=torch.int64, device=dev))
    if info.world_size > 1:
        dist.all_reduce(scalars)
        scalars /= info.world_size
        dist.all_reduce(tokens_LE)
    loss_v, aux_v, dropped_v, entropy_v = scalars.tolist()
    load_LE = tokens_LE.double() / tokens_LE.sum(-1, keepdim=True).clamp_min(1)
    return {
        "loss": loss_v,
        "aux_loss": aux_v,
        "dropped_fraction": dropped_v,
        "router_entropy": entropy_v,
        "tokens_per_expert": tokens_LE.tolist(),
        "expert_load": load_LE.tolist(),
    }


def wandb_flat(record: dict) -> dict:
    """A metrics record as wandb scalars (per-expert load as ``load/layer{l}/expert{e}``)."""
    flat = {k: v for k, v in record.items() if k not in ("step", "tokens_per_expert", "expert_load")}
    for layer, load_E in enumerate(record.get("expert_load", [])):
        for e, v in enumerate(load_E):
            flat[f"load/layer{layer}/expert{e}"] = v
    return flat


# -- wandb --------------------------------------------------------------------------------
def resolve_wandb_mode(requested: str | None) -> str:
    """The mode asked for, else $WANDB_MODE, else online iff $WANDB_API_KEY is set, else offline.
    Offline and disabled never touch the network; online is only chosen with a key (no prompt)."""
    if requested:
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def init_wandb(cfg: TrainConfig, mcfg: ModelConfig, info: DistInfo, run_id: str | None = None):
    """A wandb run on rank 0 (None elsewhere, and in disabled mode, where wandb is not imported).
    ``run_id`` (saved in checkpoints) makes a resumed run continue the same wandb run."""
    mode = resolve_wandb_mode(cfg.wandb_mode)
    if not info.is_main or mode == "disabled":
        return None
    import wandb

    run_dir = Path(cfg.wandb_dir or cfg.checkpoint_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg), "world_size": info.world_size}
    return wandb.init(
        project=cfg.wandb_project, name=cfg.wandb_run_name, config=config, dir=str(run_dir), mode=mode,
        id=run_id, resume="allow" if run_id else None, settings=wandb.Settings(silent=True),
    )


# -- checkpoints --------------------------------------------------------------------------
def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                    mcfg: ModelConfig, info: DistInfo | None = None, wandb_run_id: str | None = None) -> None:
    """Write the checkpoint atomically (a temporary file in the same directory, then rename) on
    rank 0. Call on every rank: sharded experts and their optimizer state are gathered first,
    so the file is a single-process checkpoint, loadable on any number of processes."""
    model_state, optimizer_state = full_state_dict(model), full_optimizer_state_dict(model, optimizer)
    if info is not None and not info.is_main:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    state = {
        "step": step,
        "model": model_state,
        "optimizer": optimizer_state,
        "train_config": dataclasses.asdict(cfg),
        "model_config": dataclasses.asdict(mcfg),
        "wandb_run_id": wandb_run_id,
    }
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    mcfg: ModelConfig) -> tuple[int, str | None]:
    """Restore model and optimizer from ``path`` (sharding experts as the model needs); return
    (steps already taken, wandb run id)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["model_config"] != dataclasses.asdict(mcfg):
        raise ValueError(f"checkpoint {path} was written for a different model: {state['model_config']}")
    load_full_state_dict(model, state["model"])
    load_full_optimizer_state_dict(model, optimizer, state["optimizer"])
    return int(state["step"]), state.get("wandb_run_id")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the records with step <= last_step (a resumed run rewrites the steps after it)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


# -- the loop -----------------------------------------------------------------------------
def train(cfg: TrainConfig, corpus: Corpus | None = None) -> TrainResult:
    """Train one model as ``cfg`` says (see the module docstring for the distributed contract)."""
    info = setup_distributed(cfg.device)
    try:
        check_expert_parallel(cfg, info)
        return _train(cfg, corpus, info)
    finally:
        if info.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, corpus: Corpus | None, info: DistInfo) -> TrainResult:
    if corpus is None:
        corpus = load_corpus(cfg.data, cfg.val_fraction, cfg.max_bytes, cfg.canary_vocab)
    mcfg = model_config(cfg, corpus.vocab_size)
    model = build_model(mcfg, cfg.seed, info.device, dist.group.WORLD if cfg.expert_parallel > 1 else None)
    if info.world_size > 1:
        share_router_statistics(model, dist.group.WORLD)
    optimizer = make_optimizer(model, cfg)
    ckpt = Path(cfg.checkpoint_dir) / CHECKPOINT_NAME if cfg.checkpoint_dir else None
    start, run_id = load_checkpoint(ckpt, model, optimizer, mcfg) if cfg.resume and ckpt.exists() else (0, None)
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
                   f"model: {model.num_parameters():,} parameters, router {cfg.router} {cfg.router_options}")

    def run_eval() -> dict:
        return evaluate(model, corpus.val, cfg.seq_len, cfg.eval_windows, cfg.causal_stride, cfg.eval_batch_size,
                        info.device)

    entropy = RouterEntropy(model)
    history: list[dict] = []
    final_eval: dict = {}
    train_time = 0.0
    model.train()
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, desc=f"train {cfg.router}",
               disable=not (info.is_main and cfg.progress), dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step - 1, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx_BT, targets_BT = local_batch(corpus, cfg, step, info)
        entropy.pop()
        with autocast(info.device):
            out = model(idx_BT, targets_BT)
        loss = out.loss + out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_info = reduce_gradients(model, info, cfg.grad_reduce_dtype)
        grad_norm = clip_grad_norm_(model, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        sync_router_state(model, info)
        update_routers(model)
        record = {"step": step, **step_metrics(out, entropy.pop(), info)}
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
        if ckpt is not None and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            save_checkpoint(ckpt, model, optimizer, step, cfg, mcfg, info, run.id if run is not None else None)
    bar.close()
    entropy.close()
    if not final_eval:
        final_eval = run_eval()
    if run is not None:
        run.summary.update({f"final/{k}": v for k, v in final_eval.items()})
        run.finish()
    if info.world_size > 1:
        share_router_statistics(model, None)  # the returned model's routers count locally again
        dist.barrier()  # no rank tears the group down while rank 0 still writes its checkpoint
    return TrainResult(model, mcfg, history, final_eval, train_time)


# -- command line -------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def parse_value(text: str):
    """A command-line value as int, float, bool (true/false) or str, in that order."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(items: list[str]) -> dict:
    """``["top_k=2", "capacity_factor=1.0"]`` -> ``{"top_k": 2, "capacity_factor": 1.0}``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_value(value.strip())
    return options


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: set[str] = frozenset(),
                       dest_prefix: str = "", defaults_none: bool = False) -> None:
    """One flag per field of ``cls`` (``--seq-len``), typed and documented from the dataclass.
    With ``defaults_none`` every default is None (meaning: keep the value from elsewhere)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        if base not in (int, float, str, bool):
            continue
        default = None if defaults_none else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kwargs = {"dest": dest_prefix + f.name, "default": default, "metavar": f.name.upper(), "help": f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")}
        flag = "--" + f.name.replace("_", "-")
        if base is bool:
            del kwargs["metavar"]
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(flag, type=base, **kwargs)


MODEL_PREFIX = "model__"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a small MoE language model with any router (single process or torchrun data parallel).",
    )
    add_dataclass_args(parser, TrainConfig, skip={"router_options", "model"})
    parser.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a router option, repeatable: --router-option top_k=2 --router-option capacity_factor=1.0")
    group = parser.add_argument_group("model overrides (default: the preset's value)")
    add_dataclass_args(group, ModelConfig, skip={"vocab_size", "router", "router_options"}, dest_prefix=MODEL_PREFIX,
                       defaults_none=True)
    return parser


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    router_options = parse_options(ns.pop("router_option"))
    model = {k[len(MODEL_PREFIX):]: v for k, v in list(ns.items()) if k.startswith(MODEL_PREFIX)}
    for k in list(ns):
        if k.startswith(MODEL_PREFIX):
            del ns[k]
    return TrainConfig(**ns, router_options=router_options, model={k: v for k, v in model.items() if v is not None})


def main(argv: list[str] | None = None) -> TrainResult:
    return train(config_from_args(argv))
