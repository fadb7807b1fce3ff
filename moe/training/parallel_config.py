"""The ``[parallel]`` and ``[lossy]`` sections of a run: how it is spread over processes and
devices (:class:`ParallelConfig`), and the simulated lossy transport of its data parallelism
(:class:`LossyConfig`). Flat, as the command line and TOML files spell them; what
``moe.parallel`` is given are the typed parts: the :class:`~moe.parallel.mesh.Layout`
(:meth:`ParallelConfig.layout`) and the :class:`~moe.parallel.placement.PlacementOptions`
(:meth:`ParallelConfig.placement_options`). The rest is the loop's (the device, the collective
timeout, malloc's threshold) and the step strategies' (the pipeline schedule, the microbatches)."""

from __future__ import annotations

from dataclasses import dataclass

from moe.checks import nonnegative_int, positive_int
from moe.parallel.lossy import LossConfig, LossyDPConfig
from moe.parallel.mesh import Layout
from moe.parallel.pipeline import virtual_stages
from moe.parallel.placement import PlacementOptions


@dataclass
class ParallelConfig:
    """How the run is spread over processes and devices."""

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
    """Q: pipeline stages (``moe.parallel.pipeline``): the blocks are cut into Q consecutive
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
    activation_checkpointing: str = "none"
    """Per transformer block (``moe.parallel.recompute``): none; full (a block
    keeps only its input and reruns its forward in the backward); selective (a block keeps its
    matmul and attention outputs and recomputes the rest). Same losses and gradients."""
    compile: bool = False
    """Compile each transformer block's forward with torch.compile (in place; ``moe.parallel.compile``);
    with activation_checkpointing full, the checkpoint stays eager around it (not selective)."""
    cpu_mmap_threshold_kib: int = 1024
    """On CPU under glibc, malloc's mmap threshold in KiB, set when the run starts
    (``moe.parallel.memory.limit_cpu_malloc``): larger blocks are mapped and returned when
    freed, so FSDP2's freed collective buffers leave the resident set and peak_memory_mib
    follows the tensors (docs/scaling.md: 4 ranks of the 268M model). 0 leaves glibc's dynamic
    default; $MALLOC_MMAP_THRESHOLD_, when set, wins over both."""
    cpu_malloc_keep: bool = False
    """On CPU under glibc, keep freed memory in the process instead (replaces
    cpu_mmap_threshold_kib; ``moe.parallel.memory.KEEP_FREED``): every step reuses pages
    already mapped (the router study's large rows: 1.03x dense, 1.09x top-k per step), and
    peak_memory_mib also counts what the allocator keeps. $MALLOC_MMAP_THRESHOLD_ still wins."""
    expert_exchange: str = "per_assignment"
    """With expert_parallel > 1, what the all-to-all sends (``moe.parallel.exchange``):
    per_assignment (a token's row once per chosen expert) or dedup (once per rank holding one of
    its experts, the rank's partial sums coming back: fewer bytes when a token's experts share a
    rank, e.g. under group-limited routing). Same outputs and gradients up to summation order."""
    grad_reduce_dtype: str = "fp32"
    """Precision of the data-parallel gradient reduce-scatter: fp32, or bf16 to measure the bias
    low precision adds (bf16 is applied; its difference from an fp32 reduction of the same
    gradients on the same step is logged as grad_reduce_rel_diff and grad_reduce_max_abs_diff)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "expert_parallel", "pipeline_parallel", "microbatches"):
            positive_int(name, getattr(self, name))
        if self.cpu_mmap_threshold_kib < 0:
            raise ValueError(
                f"cpu_mmap_threshold_kib must be >= 0 (0: glibc's default), got {self.cpu_mmap_threshold_kib}"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        self.placement_options()  # validates the exchange, the reduce dtype, compile and checkpointing
        virtual_stages(self.pipeline_schedule)  # validates the name

    def layout(self, world_size: int) -> Layout:
        """The layout of ``world_size`` processes (``moe.parallel.mesh.Layout.from_world``)."""
        return Layout.from_world(world_size, self.dp_replicate, self.expert_parallel, self.pipeline_parallel)

    def placement_options(self) -> PlacementOptions:
        """How ``moe.parallel.placement`` runs and shards the placed model's blocks."""
        return PlacementOptions(
            self.expert_exchange, self.compile, self.activation_checkpointing, self.grad_reduce_dtype
        )


@dataclass
class LossyConfig:
    """The lossy transport of a data-parallel run (off unless ``packet_loss`` > 0)."""

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

    def __post_init__(self) -> None:
        if not 0.0 <= self.packet_loss < 1.0:
            raise ValueError(f"packet_loss must be in [0, 1), got {self.packet_loss!r}")
        if self.loss_burst != 0.0 and self.loss_burst < 1.0:
            raise ValueError(
                f"loss_burst must be 0 (independent losses) or a mean burst length >= 1, got {self.loss_burst!r}"
            )
        positive_int("loss_packet_size", self.loss_packet_size)
        nonnegative_int("loss_resync_every", self.loss_resync_every)
        self.transport(seed=0, grad_clip=0.0)  # validates the policy

    def transport(self, seed: int, grad_clip: float) -> LossyDPConfig:
        """The ``moe.parallel.lossy`` configuration (the loss pattern seeded by ``seed``)."""
        loss = LossConfig(
            rate=self.packet_loss, packet_size=self.loss_packet_size, burst_length=self.loss_burst or None, seed=seed
        )
        return LossyDPConfig(
            policy=self.loss_policy, loss=loss, resync_every=self.loss_resync_every, grad_clip=grad_clip
        )
