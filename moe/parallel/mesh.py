"""The DeviceMesh of a training run: pipeline x replicated data parallel x sharded data parallel
x expert parallel, and FSDP2 (``fully_shard``) applied over it.

Shape legend: W world size, Q pipeline degree, R replicate degree, S shard degree left for the
experts, P expert-parallel degree, DP = R*S*P data-parallel ranks per pipeline stage, E experts,
L = E/P experts per expert-parallel rank.

The world is laid out as a mesh (Q, R, S, P) with W = Q*DP, named ``("pp", "dp_replicate",
"dp_shard", "ep")``; ``"dp"`` is ``(dp_replicate, dp_shard, ep)`` flattened (the DP ranks of one
pipeline stage) and ``"fsdp"`` is ``(dp_shard, ep)`` flattened (S*P ranks). The ranks of one
pipeline stage hold the same blocks (``moe.parallel.pipeline``); everything below happens
within a stage, and with Q = 1 the stage is the whole model. Every rank of a stage is its own
data-parallel rank: it draws its own slice of the global batch (data parallel degree DP); the
ranks of one ``pp`` group (same data-parallel index, consecutive stages) share a slice.

* **dense weights** (attention, norms, embeddings, routers): FSDP2 over ``fsdp`` (S*P ranks),
  replicated over ``dp_replicate`` (HSDP when R > 1);
* **expert weights**: split over ``ep`` (rank e of an expert-parallel group holds experts
  [e*L, (e+1)*L)), then FSDP2 over ``dp_shard`` (S ranks), replicated over ``dp_replicate``;
* the token all-to-all runs on the ``ep`` group (P consecutive ranks).

Gradients. Rank r's loss is the mean over its own tokens, so the single-process gradient is the
mean over the DP ranks' gradients. FSDP2 divides a dense gradient by its mesh size R*S*P = DP. An
expert's local gradient already sums every rank of its ``ep`` group (the reverse exchange brings
the rows home), and FSDP2 sums it over the R*S ranks of its own mesh: the single-process
gradient is that sum over all DP ranks divided by DP, not by R*S, so the expert units get the
divide factor DP (``set_gradient_divide_factor``). gloo has no ``PREMUL_SUM``, so on the CPU the
expert units reduce with plain sums and scale separately (``set_force_sum_reduction_for_comms``),
except when S = 1: there torch 2.13's FSDP2 skips the reduce-scatter and divides by the factor
in its place, and with forced sums divides a second time (measured: gradients W times too
small), while without them the factor applies once and the replicate all-reduce is a plain sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moe.checks import positive_int
from moe.parallel.exchange import ExpertParallel
from moe.parallel.state import expert_parallel_layers

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep")


@dataclass(frozen=True)
class Layout:
    """How W processes split into pipeline x replicated data parallel x sharded data parallel x
    expert parallel; validated on construction. Build one with :meth:`from_world`."""

    dp_replicate: int
    """R: replicas of every weight shard (HSDP when > 1)."""
    dp_shard: int
    """S: FSDP2 degree of the expert weights; dense weights are sharded over S*P ranks."""
    expert_parallel: int
    """P: expert-parallel degree (experts split into P blocks; 1 = plain FSDP2)."""
    pipeline: int = 1
    """Q: pipeline stages (ranks holding consecutive blocks; 1 = no pipeline)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "expert_parallel", "pipeline"):
            positive_int(f"Layout.{name}", getattr(self, name))

    @classmethod
    def from_world(cls, world_size: int, dp_replicate: int = 1, expert_parallel: int = 1, pipeline: int = 1) -> Layout:
        """The layout of ``world_size`` processes with R = ``dp_replicate``, P = ``expert_parallel``
        and Q = ``pipeline``; sharded data parallel takes the rest, S = W / (Q*R*P)."""
        for name, v in (("dp_replicate", dp_replicate), ("expert_parallel", expert_parallel), ("pipeline", pipeline)):
            positive_int(name, v)
        if world_size % (pipeline * dp_replicate * expert_parallel):
            raise ValueError(
                f"pipeline={pipeline} x dp_replicate={dp_replicate} x expert_parallel={expert_parallel} must divide "
                f"the number of processes ({world_size})"
            )
        return cls(dp_replicate, world_size // (pipeline * dp_replicate * expert_parallel), expert_parallel, pipeline)

    @property
    def data_parallel(self) -> int:
        """DP = R*S*P: data-parallel ranks of one pipeline stage."""
        return self.dp_replicate * self.dp_shard * self.expert_parallel

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_parallel

    def check_experts(self, num_experts: int) -> None:
        """ValueError unless P divides the number of experts."""
        if num_experts % self.expert_parallel:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} must divide num_experts={num_experts} "
                "(every expert-parallel rank holds the same number of experts)"
            )

    def __str__(self) -> str:
        dims = f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x ep={self.expert_parallel}"
        return dims if self.pipeline == 1 else f"pp={self.pipeline} x {dims}"


class ParallelMesh:
    """The DeviceMesh of a :class:`Layout` and its sub-meshes (a collective to build: every
    rank of the default process group must construct it, in the same order)."""

    def __init__(self, layout: Layout, device_type: str = "cpu") -> None:
        if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
            have = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise ValueError(f"layout {layout} needs {layout.world_size} processes, have {have}")
        self.layout = layout
        self.device_type = device_type
        self.mesh = init_device_mesh(
            device_type,
            (layout.pipeline, layout.dp_replicate, layout.dp_shard, layout.expert_parallel),
            mesh_dim_names=MESH_DIMS,
        )
        # The flattened meshes are kept here, never sliced back out of the root mesh (torch
        # deprecates that, with a warning on every rank); HSDP's (replicate, fsdp) mesh is the
        # flattened "dp" unflattened again, so it names the same process groups.
        self.fsdp_mesh = self.mesh["dp_shard", "ep"]._flatten("fsdp")
        """(dp_shard, ep) flattened: the S*P ranks dense weights are sharded over."""
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard", "ep"]._flatten("dp")
        """(dp_replicate, dp_shard, ep) flattened: the DP ranks of this rank's pipeline stage."""
        self.dense_mesh = (
            self.fsdp_mesh
            if layout.dp_replicate == 1
            else self.dp_mesh._unflatten(
                0, (layout.dp_replicate, layout.dp_shard * layout.expert_parallel), ("replicate", "fsdp")
            )
        )
        """FSDP2 mesh of the dense weights: (fsdp,), or (replicate, fsdp) for HSDP."""

    @property
    def stage_mesh(self) -> DeviceMesh:
        """This rank's pipeline stage: the mesh (dp_replicate, dp_shard, ep)."""
        return self.mesh["dp_replicate", "dp_shard", "ep"]

    @property
    def dp_group(self):
        """The data-parallel ranks of this rank's pipeline stage (all ranks when Q = 1)."""
        return self.dp_mesh.get_group()

    @property
    def pp_group(self):
        """The pipeline ranks of this rank's data-parallel index (stage order)."""
        return self.mesh["pp"].get_group()

    def coordinate(self) -> tuple[int, int]:
        """(pipeline rank, data-parallel rank) of this process."""
        return self.mesh["pp"].get_local_rank(), self.dp_mesh.get_local_rank()

    def global_rank(self, pp: int, dp: int) -> int:
        """The global rank at pipeline rank ``pp`` and data-parallel rank ``dp``."""
        return pp * self.layout.data_parallel + dp

    @property
    def expert_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of the expert weights: (dp_shard,) or (dp_replicate, dp_shard)."""
        return self.mesh["dp_shard"] if self.layout.dp_replicate == 1 else self.mesh["dp_replicate", "dp_shard"]

    def expert_parallel(self, dedup: bool = False) -> ExpertParallel | None:
        """The data path to hand to the MoE layers (None when P = 1: experts stay whole and are
        sharded with the dense weights); ``dedup``: the rank-deduplicated exchange."""
        if self.layout.expert_parallel == 1:
            return None
        return ExpertParallel(self.mesh["ep"].get_group(), self.stage_mesh, dedup=dedup)


def mixed_precision(device: torch.device, reduce_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """bf16 compute with ``reduce_dtype`` gradient reduction on CUDA; on the CPU parameters stay
    fp32 (``reduce_dtype`` still applies, to measure low-precision reduction)."""
    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard_model(model: nn.Module, pmesh: ParallelMesh, units: list[nn.Module], mp_policy: MixedPrecisionPolicy) -> None:
    """Apply FSDP2 over ``pmesh`` in place, bottom-up: every expert-parallel layer's experts as
    one unit on the expert mesh (its other children, e.g. the router, as units on the dense
    mesh), each of ``units`` (e.g. the transformer blocks) and finally ``model`` on the dense
    mesh. Expert weights are sharded on dim 1 (dim 0 is the expert index the ``ep`` dim splits),
    so a checkpoint can describe them as one [E, ...] tensor (``moe.parallel.sharded_state``)."""
    world = pmesh.layout.data_parallel
    force_sum = pmesh.device_type == "cpu" and pmesh.layout.dp_shard > 1  # see the module docstring
    for layer in expert_parallel_layers(model).values():
        for child in layer.children():
            if child is not layer.experts and any(True for _ in child.parameters()):
                fully_shard(child, mesh=pmesh.dense_mesh, mp_policy=mp_policy)
        fully_shard(layer, mesh=pmesh.expert_mesh, mp_policy=mp_policy, shard_placement_fn=lambda p: Shard(1))
        layer.set_gradient_divide_factor(float(world))
        layer.set_force_sum_reduction_for_comms(force_sum)
    for unit in units:
        if not isinstance(unit, FSDPModule):  # an expert-parallel layer is a unit already
            fully_shard(unit, mesh=pmesh.dense_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=pmesh.dense_mesh, mp_policy=mp_policy)


def fsdp_units(blocks: list[nn.Module], min_fraction: float = 1 / 8) -> list[nn.Module]:
    """The FSDP2 units for ``blocks``, bottom-up: every child of a block holding at least
    ``min_fraction`` of the block's parameters (in a transformer block: the attention and the
    feed-forward, not the norms), then the block itself (the rest). Gathering one such child at
    a time instead of a whole block lowers the per-rank peak (measured on the 268M model over 4
    CPU ranks: 1,582 MiB instead of 1,680 MiB, ``experiments/bench_memory.py``)."""
    units = []
    for block in blocks:
        total = sum(p.numel() for p in block.parameters())
        units += [c for c in block.children() if sum(p.numel() for p in c.parameters()) >= min_fraction * total > 0]
        units.append(block)
    return units
