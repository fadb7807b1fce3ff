"""TrainConfig: every field of one training run, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from moe.model import ModelConfig
from moe.parallel.lossy import LossConfig, LossyDPConfig
from moe.training.pipeline import virtual_stages

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
    """Write sharded checkpoints (``step-NNNNNNNN/``, DCP: every rank writes its shards) here,
    atomically, every ``checkpoint_every`` steps and after the last step."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only after the last step)."""
    keep_checkpoints: int = 2
    """K: keep the last K complete checkpoints."""
    export_model: bool = False
    """After the last step also write ``checkpoint_dir/model.pt``, the consolidated single-process
    state dict (every rank gathers the whole model: for small models)."""
    resume: bool = False
    """Continue from the last complete checkpoint in ``checkpoint_dir`` if there is one (written on
    any layout or number of processes); start afresh if there is none (so a run restarted by
    ``torchrun --max-restarts`` resumes)."""
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
    dp_replicate: int = 1
    """R: replicated data-parallel degree (HSDP: each weight shard kept on R ranks); must divide
    the number of processes together with ``expert_parallel`` (``moe.parallel.mesh``)."""
    expert_parallel: int = 1
    """P: expert-parallel degree: the experts are split into P blocks, one per rank of an
    expert-parallel group, and FSDP2-sharded over what remains; P must divide the number of
    processes and num_experts. 1 = plain FSDP2 on more than one process."""
    pipeline_parallel: int = 1
    """Q: pipeline stages (``moe.training.pipeline``): the blocks are cut into Q consecutive
    stages, one per pipeline rank, scheduled by ``pipeline_schedule`` over ``microbatches``
    microbatches; Q x dp_replicate x expert_parallel must divide the number of processes. 1 = no pipeline."""
    pipeline_schedule: str = "1f1b"
    """With pipeline_parallel > 1: gpipe, 1f1b or interleaved1f1b (two stages per pipeline rank)."""
    microbatches: int = 1
    """M: each rank's share of the batch is split into M equal microbatches whose gradients are
    accumulated (the pipeline's microbatches with pipeline_parallel > 1)."""
    collective_timeout_s: float = 600.0
    """Every collective of the process group (joined by the loop) fails after this many seconds
    instead of hanging when a peer stops answering."""
    grad_reduce_dtype: str = "fp32"
    """Precision of the data-parallel gradient reduce-scatter: fp32, or bf16 to measure the bias
    low precision adds (bf16 is applied; its difference from an fp32 reduction of the same
    gradients on the same step is logged as grad_reduce_rel_diff and grad_reduce_max_abs_diff)."""
    packet_loss: float = 0.0
    """p > 0: data parallelism over a simulated lossy transport (``moe.parallel.lossy``): every
    parameter replicated, gradients reduce-scattered to shard owners and parameters broadcast
    back, each packet lost with probability p (FSDP2 is not used). Logs received_fraction,
    grad_rel_error, grad_bias (against the reliable mean of the same gradients), max_drift and
    rms_drift (spread between the ranks' replicas) every step."""
    loss_policy: str = "unbiased"
    """With packet_loss: what a shard owner makes of the packets that arrived: unbiased (average
    of what arrived), naive (lost packets count as zeros), reweighted (inverse-probability
    weights) or reliable (the baseline: the transport is bypassed)."""
    loss_burst: float = 0.0
    """With packet_loss: mean burst length of lost packets (Gilbert's channel); 0 = independent losses."""
    loss_packet_size: int = 1024
    """With packet_loss: elements per packet."""
    loss_resync_every: int = 0
    """With packet_loss: every K-th parameter broadcast is reliable (0 = never)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    hf_model: str | None = None
    """Train a Hugging Face transformers MoE model instead of the preset (needs the [hf] extra):
    a local directory (weights, or a config.json alone for random weights) or a built-in tiny
    random config (``moe.integrations.hf.TINY_CONFIGS``, e.g. olmoe-tiny); its MoE blocks route
    with ``router`` (topk without options keeps the family's own routing). Never downloads."""

    def __post_init__(self) -> None:
        positive = ("max_bytes", "seq_len", "batch_size", "steps", "eval_windows", "eval_batch_size", "causal_stride",
                    "dp_replicate", "expert_parallel", "canary_vocab", "pipeline_parallel", "microbatches")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "eval_every", "log_every", "checkpoint_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 0, got {v!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
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
        if (self.resume or self.export_model) and not self.checkpoint_dir:
            raise ValueError("resume and export_model need checkpoint_dir")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an integer >= 1, got {self.keep_checkpoints!r}")
        if not 0.0 <= self.packet_loss < 1.0:
            raise ValueError(f"packet_loss must be in [0, 1), got {self.packet_loss!r}")
        if self.packet_loss > 0 and (self.expert_parallel > 1 or self.hf_model or self.grad_reduce_dtype != "fp32"):
            raise ValueError("packet_loss replicates every parameter over plain data parallelism: "
                             "no expert_parallel, hf_model or grad_reduce_dtype with it")
        if self.loss_burst != 0.0 and self.loss_burst < 1.0:
            raise ValueError(f"loss_burst must be 0 (independent losses) or a mean burst length >= 1, got {self.loss_burst!r}")
        self.lossy_data_parallel()  # validates loss_policy, loss_packet_size, loss_resync_every
        virtual_stages(self.pipeline_schedule)  # validates the name
        if self.pipeline_parallel > 1 and (self.packet_loss > 0 or self.hf_model):
            raise ValueError("pipeline_parallel runs the preset model over a reliable network: no packet_loss or hf_model")
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by microbatches={self.microbatches}")
        if self.hf_model and (self.expert_parallel > 1 or set(self.model) - {"backend"}):
            raise ValueError("hf_model takes its architecture from its transformers config: no model overrides "
                             "(except backend) and no expert_parallel")
        model_fields = {f.name for f in fields(ModelConfig)} - {"vocab_size", "router", "router_options"}
        bad = set(self.model) - model_fields
        if bad:
            raise ValueError(f"unknown model overrides {sorted(bad)}; known: {sorted(model_fields)}")

    def lossy_data_parallel(self) -> LossyDPConfig:
        """The ``moe.parallel.lossy`` configuration of ``packet_loss`` and the ``loss_*`` fields
        (the loss pattern is seeded by ``seed``)."""
        loss = LossConfig(rate=self.packet_loss, packet_size=self.loss_packet_size,
                          burst_length=self.loss_burst or None, seed=self.seed)
        return LossyDPConfig(policy=self.loss_policy, loss=loss, resync_every=self.loss_resync_every,
                             grad_clip=self.grad_clip)
