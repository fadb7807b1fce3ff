"""Where one rank's part of the model lives, decided once per run, in two steps around what the
caller cuts out of the model in between (a pipeline stage): :func:`build_placement` builds the
DeviceMesh of a :class:`~moe.parallel.mesh.Layout` and the model for it (experts already cut for
expert parallelism); :func:`shard_placement` compiles and checkpoints the rank's blocks, shards
them with FSDP2 over the stage's data-parallel ranks (``moe.parallel.mesh``), materialises this
rank's shards and makes the routers count over those ranks.

Both take the layout and :class:`PlacementOptions`, never a run's config, and never the model's
class: the builder makes the model. ``moe.training.placement`` places a training run's model
this way, with the step strategy its config selects cutting the model in between.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.parallel.compile import compile_blocks
from moe.parallel.materialize import materialize
from moe.parallel.mesh import Layout, ParallelMesh, fsdp_units, mixed_precision, shard_model
from moe.parallel.recompute import MODES as AC_MODES
from moe.parallel.recompute import SELECTIVE_COMPILED_REFUSAL, apply_activation_checkpointing
from moe.parallel.reduce_precision import MeasuredReduceScatter
from moe.parallel.state import share_router_statistics
from moe.routing import Router

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXCHANGES = ("per_assignment", "dedup")


@dataclass(frozen=True)
class PlacementOptions:
    """How the placed model's blocks run and its gradients are reduced (the layout aside);
    validated on construction."""

    expert_exchange: str = "per_assignment"
    """With expert parallelism, what the all-to-all sends (``moe.parallel.exchange``):
    per_assignment or dedup (once per rank holding one of a token's experts)."""
    compile: bool = False
    """Compile each block's forward in place (``moe.parallel.compile``)."""
    activation_checkpointing: str = "none"
    """Per block (``moe.parallel.recompute``): none, full or selective."""
    grad_reduce_dtype: str = "fp32"
    """Precision of the FSDP2 gradient reduce-scatter: fp32, or bf16 applied and measured
    against fp32 (``moe.parallel.reduce_precision``)."""

    def __post_init__(self) -> None:
        if self.expert_exchange not in EXCHANGES:
            raise ValueError(f"expert_exchange must be one of {', '.join(EXCHANGES)}, got {self.expert_exchange!r}")
        if self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"grad_reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {self.grad_reduce_dtype!r}"
            )
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"activation_checkpointing must be one of {', '.join(AC_MODES)}, got {self.activation_checkpointing!r}"
            )
        if self.compile and self.activation_checkpointing == "selective":
            raise ValueError(SELECTIVE_COMPILED_REFUSAL)


@dataclass
class Placement:
    """This rank's model and the groups of its step."""

    model: nn.Module
    """What this rank trains: the whole model (FSDP2-sharded when sharded) or its pipeline stage."""
    eval_model: nn.Module
    """What evaluation calls: ``model``, or a ``PipelinedLM`` over the stages."""
    layout: Layout
    mesh: ParallelMesh | None
    """The DeviceMesh of the layout (None on one process, and for a model placed off the mesh)."""
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

    def uncounted(self) -> tuple:
        """Parameters the gradient norm must not count twice (the last stage's tied head)."""
        return self.stage.uncounted() if self.stage is not None else ()

    def num_moe_layers(self) -> int:
        """L: MoE layers of the whole model (a stage knows the whole model's count)."""
        if self.stage is not None:
            return self.stage.num_moe_layers
        return sum(isinstance(m, Router) for m in self.model.modules())


def _blocks(model: nn.Module, options: PlacementOptions) -> list[nn.Module]:
    """The transformer blocks this rank holds (a stage's, or the whole model's)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        if options.compile or options.activation_checkpointing != "none":
            raise ValueError(
                "--compile and --activation-checkpointing apply to a model's transformer blocks (its `blocks`), "
                f"and {type(model).__name__} has none"
            )
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def build_placement(
    layout: Layout,
    options: PlacementOptions,
    build: Callable[[object], nn.Module],
    device: torch.device,
    rank: int,
    on_mesh: bool = True,
) -> Placement:
    """Build the DeviceMesh of ``layout`` (on more than one process, when ``on_mesh``) and the
    model with ``build(expert_parallel)`` (a ``moe.parallel.ExpertParallel`` or None; parameters
    may be on the meta device, then :func:`shard_placement` fills them). The placement starts
    with the whole model and every process (``rank`` this one's) a data-parallel rank; a caller
    may cut the model (a pipeline stage) and set the groups before :func:`shard_placement`.
    A collective: every rank calls it."""
    world = layout.world_size
    pmesh = ParallelMesh(layout, device.type) if world > 1 and on_mesh else None
    model = build(pmesh.expert_parallel(dedup=options.expert_exchange == "dedup") if pmesh is not None else None)
    return Placement(
        model,
        model,
        layout,
        pmesh,
        device,
        rank,
        world,
        dist.group.WORLD if world > 1 else None,
        sharded=pmesh is not None and layout.data_parallel > 1,
    )


def shard_placement(place: Placement, options: PlacementOptions, init_parameter: Callable[[str, Tensor], None]) -> None:
    """Compile and checkpoint the blocks of ``place.model`` (in that order), shard it with FSDP2
    over the stage's data-parallel ranks, materialise this rank's shards with the built model's
    ``init_parameter(name, full)`` (``moe.parallel.materialize``: no rank ever holds the whole
    model) and make its routers count load-balancing fractions over those ranks. A collective."""
    blocks = _blocks(place.model, options)
    if options.compile:
        compile_blocks(blocks)
    apply_activation_checkpointing(blocks, options.activation_checkpointing)
    if place.sharded:
        # Blocks return views (reshapes); nothing here modifies a block's output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        shard_model(place.model, place.mesh, fsdp_units(blocks), mixed_precision(place.device, torch.float32))
        if options.grad_reduce_dtype != "fp32":  # applied, and measured against fp32
            place.reduce_hook = MeasuredReduceScatter(REDUCE_DTYPES[options.grad_reduce_dtype])
            place.reduce_hook.install(place.model)
    if any(p.is_meta for p in place.model.parameters()):
        materialize(place.model, place.device, init_parameter)
    if place.dp_size > 1:
        share_router_statistics(place.model, place.dp_group)
