"""Build a model on the meta device, place it, then give each rank only its own shards.

Shape legend: E experts, L = E/P experts on an expert-parallel rank.

    with parameters_on_meta():
        model = build(...)                       # parameters on "meta": no memory, no init
    shard / cut the model (FSDP2, expert parallel, a pipeline stage)
    materialize(model, device, fill)             # each rank allocates and fills its shards

``fill(name, full)`` fills ``full``, the parameter ``name`` at its single-process shape, in
place; the model supplies it (``MoETransformer.init_parameter``), and its own single-process
initialisation uses the same function, so both draw the same numbers. Parameters are
generated one at a time and only the local piece is kept: the peak beyond the rank's shards
is one whole parameter, never the model.

Buffers (rotary tables, router statistics) are small and built for real: only parameters go
to the meta device. The single-process shape of a parameter is its global shape, except for
the experts of an expert-parallel layer (found by its injected ``ExpertParallel``): this rank
holds experts [start, stop) of E, so the full tensor has E on dim 0 and the rank keeps that
slice, which FSDP2 may shard further (a DTensor: its local piece of the slice).

A model whose initialisation is not a function of a parameter's name (a transformers model:
its own initialiser, or weights loaded from disk) is built once on one rank and handed out
with :class:`FromSource`: that rank copies each whole parameter, in turn, into ``full`` and
broadcasts it; every rank keeps its piece. Only the source rank ever holds the whole model,
and it lets go of each parameter once it has been sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe.parallel.state import expert_parallel_layers


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no storage, and the
    initialisers that run on them draw nothing); buffers are built as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _expert_slices(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (E, start, stop) for the experts of each expert-parallel layer."""
    out = {}
    for name, layer in expert_parallel_layers(model).items():
        start, stop = layer.local_experts
        for pname, _ in layer.experts.named_parameters():
            out[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = (layer.num_experts, start, stop)
    return out


def _to_empty_keeping_ties_and_buffers(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, then the buffers' values restored and parameters that were
    one object in several modules (tied embeddings) made one object again."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, pname))
    model.to_empty(device=device)
    for sharing in owners.values():
        (first, first_name), *rest = sharing
        for module, pname in rest:
            setattr(module, pname, getattr(first, first_name))
    with torch.no_grad():
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, fill: Callable[[str, Tensor], None]) -> None:
    """Allocate ``model``'s parameters on ``device`` and fill each rank's pieces from the full
    single-process tensors ``fill`` generates (see the module docstring). Every parameter must
    be on the meta device (plain or an FSDP2 DTensor); no collective runs."""
    device = torch.device(device)
    real = [(name, p.device) for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"materialize needs every parameter on the meta device; {real[0][0]!r} is on {real[0][1]}")
    _to_empty_keeping_ties_and_buffers(model, device)
    experts = _expert_slices(model)
    for name, p in model.named_parameters():
        num_experts, start, stop = experts.get(name, (None, 0, p.shape[0]))
        shape = p.shape if num_experts is None else torch.Size([num_experts, *p.shape[1:]])
        full = torch.empty(shape, dtype=p.dtype)
        fill(name, full)
        piece = full[start:stop]
        if isinstance(p, DTensor):
            piece = distribute_tensor(piece, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(piece)
        else:
            p.copy_(piece)


class FromSource:
    """``fill(name, full)`` for :func:`materialize` from a model built whole on rank
    ``src`` (``source``: that model on that rank, None on every other): the source rank copies
    its parameter ``name`` into ``full`` and, when a process group is initialised, broadcasts
    it over the world (``device``: where the group's backend takes tensors, e.g. cuda for NCCL).
    Every rank must call it for the same names in the same order (``materialize`` does). Each
    source parameter is released once copied, so after materialisation nothing of the source
    is left."""

    def __init__(self, source: nn.Module | None, device: torch.device | str = "cpu", src: int = 0) -> None:
        self.device, self.src = torch.device(device), src
        self.distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if self.distributed else 0
        if (source is not None) != (rank == src):
            raise ValueError(f"FromSource: rank {rank} must {'' if rank == src else 'not '}hold the source model")
        self.params = dict(source.named_parameters()) if source is not None else None

    @torch.no_grad()
    def __call__(self, name: str, full: Tensor) -> None:
        if self.params is not None:
            if name not in self.params:
                raise ValueError(f"FromSource: the source model has no parameter {name!r}")
            value = self.params.pop(name)
            if value.shape != full.shape:
                raise ValueError(
                    f"FromSource: {name!r} is {tuple(value.shape)} in the source, {tuple(full.shape)} here"
                )
            full.copy_(value)
        if self.distributed:
            sent = full.to(self.device)
            dist.broadcast(sent, self.src)
            full.copy_(sent)
