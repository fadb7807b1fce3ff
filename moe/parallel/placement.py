"""Where one rank's part of the model lives, decided once per run: the parallel section of the
config (:class:`ParallelConfig`), the step strategy it selects (``moe.parallel.steps``), the
DeviceMesh, this rank's pipeline stage, its FSDP2 sharding over the stage's data-parallel ranks
(``moe.parallel.mesh``), and the process groups its training step needs.

:func:`place_model` is the one place that does it: it takes the run's config and a builder of
the whole model (experts already cut for expert parallelism) and returns the placed model with
its strategy. It reads the config's ``parallel`` section (and what the strategies read), never
the model's class: the builder makes the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.checks import positive_int
from moe.parallel.compile import compile_blocks
from moe.parallel.materialize import materialize
from moe.parallel.mesh import Layout, ParallelMesh, fsdp_units, mixed_precision, shard_model
from moe.parallel.pipeline import virtual_stages
from moe.parallel.recompute import MODES as AC_MODES
from moe.parallel.recompute import SELECTIVE_COMPILED_REFUSAL, apply_activation_checkpointing
from moe.parallel.reduce_precision import MeasuredReduceScatter
from moe.parallel.state import share_router_statistics
from moe.parallel.steps import choose_strategy
from moe.routing import Router

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXCHANGES = ("per_assignment", "dedup")


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
        if self.expert_exchange not in EXCHANGES:
            raise ValueError(f"expert_exchange must be one of {', '.join(EXCHANGES)}, got {self.expert_exchange!r}")
        if self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"grad_reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {self.grad_reduce_dtype!r}"
            )
        virtual_stages(self.pipeline_schedule)  # validates the name
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"activation_checkpointing must be one of {', '.join(AC_MODES)}, got {self.activation_checkpointing!r}"
            )
        if self.compile and self.activation_checkpointing == "selective":
            raise ValueError(SELECTIVE_COMPILED_REFUSAL)


@dataclass
class Placement:
    """This rank's model, the groups of its step, and the strategy that steps it."""

    model: nn.Module
    """What this rank trains: the whole model (FSDP2-sharded when sharded) or its pipeline stage."""
    eval_model: nn.Module
    """What evaluation calls: ``model``, or a ``PipelinedLM`` over the stages."""
    layout: Layout
    mesh: ParallelMesh | None
    """The DeviceMesh of the layout (None on one process, and for strategies without one)."""
    device: torch.device
    dp_rank: int
    """This rank's index among the data-parallel ranks that split the batch."""
    dp_size: int
    dp_group: object
    """The data-parallel ranks holding the same parameters (None on one process)."""
    sharded: bool
    """FSDP2 reduces the gradients (more than one data-parallel rank on a mesh)."""
    stage: nn.Module | None = None
    """This rank's ``StageModel`` under pipeline parallelism."""
    pipe: object = None
    """Its ``Pipeline`` schedule."""
    pp_group: object = None
    """The pipeline ranks of this rank's data-parallel index (None without a pipeline)."""
    tied_group: object = None
    """The first and last pipeline rank, whose copies of a tied embedding share gradients."""
    reduce_hook: MeasuredReduceScatter | None = None
    """The low-precision gradient reduce-scatter, measured against fp32 (``grad_reduce_dtype``)."""
    strategy: object = None
    """The ``moe.parallel.steps.StepStrategy`` that makes and applies this rank's gradients."""

    def uncounted(self) -> tuple:
        """Parameters the gradient norm must not count twice (the last stage's tied head)."""
        return self.stage.uncounted() if self.stage is not None else ()

    def num_moe_layers(self) -> int:
        """L: MoE layers of the whole model (a stage knows the whole model's count)."""
        if self.stage is not None:
            return self.stage.num_moe_layers
        return sum(isinstance(m, Router) for m in self.model.modules())


def _blocks(model: nn.Module, par: ParallelConfig) -> list[nn.Module]:
    """The transformer blocks this rank holds (a stage's, or the whole model's)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        if par.compile or par.activation_checkpointing != "none":
            raise ValueError(
                "--compile and --activation-checkpointing apply to a model's transformer blocks (its `blocks`), "
                f"and {type(model).__name__} has none"
            )
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def place_model(cfg, num_experts: int | None, build: Callable[[object], nn.Module], info) -> Placement:
    """Choose the step strategy of ``cfg`` (the run's config), build the mesh, build the model
    with ``build(expert_parallel)`` (a ``moe.parallel.ExpertParallel`` or None; parameters may be
    on the meta device, then the model provides ``init_parameter(name, full)``), let the strategy
    cut it (a pipeline stage), compile and checkpoint its blocks (in that order), shard it with FSDP2 over the
    stage's data-parallel ranks, materialise this rank's shards (``moe.parallel.materialize``:
    no rank ever holds the whole model), make its routers count load-balancing fractions over
    them and let the strategy finish (the pipeline schedule). ``info``: the process's rank,
    world size and device; ``num_experts`` (None: the builder checks it) must split over the
    expert-parallel ranks. A collective: every rank calls it."""
    strategy_cls = choose_strategy(cfg)
    par, world = cfg.parallel, info.world_size
    layout = Layout.from_world(world, par.dp_replicate, par.expert_parallel, par.pipeline_parallel)
    if num_experts is not None:
        layout.check_experts(num_experts)
    strategy_cls.check_world(world)
    pmesh = ParallelMesh(layout, info.device.type) if world > 1 and strategy_cls.uses_mesh else None
    model = build(pmesh.expert_parallel(dedup=par.expert_exchange == "dedup") if pmesh is not None else None)
    place = Placement(
        model,
        model,
        layout,
        pmesh,
        info.device,
        info.rank,
        world,
        dist.group.WORLD if world > 1 else None,
        sharded=pmesh is not None and layout.data_parallel > 1,
    )
    strategy = strategy_cls(place, cfg)
    local = cfg.data.batch_size // place.dp_size
    if local % par.microbatches:
        raise ValueError(
            f"a rank's batch of {local} sequences does not split into microbatches={par.microbatches} equal parts"
        )
    blocks = _blocks(place.model, par)
    if par.compile:
        compile_blocks(blocks)
    apply_activation_checkpointing(blocks, par.activation_checkpointing)
    if place.sharded:
        # Blocks return views (reshapes); nothing here modifies a block's output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        shard_model(place.model, pmesh, fsdp_units(blocks), mixed_precision(info.device, torch.float32))
        if par.grad_reduce_dtype != "fp32":  # applied, and measured against fp32
            place.reduce_hook = MeasuredReduceScatter(REDUCE_DTYPES[par.grad_reduce_dtype])
            place.reduce_hook.install(place.model)
    if any(p.is_meta for p in place.model.parameters()):
        materialize(place.model, info.device, model.init_parameter)
    if place.dp_size > 1:
        share_router_statistics(place.model, place.dp_group)
    strategy.placed()
    place.strategy = strategy
    return place
