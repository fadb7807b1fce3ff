"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), loadable into any layout.

Shape legend: E experts, L = E/P experts per expert-parallel rank, D model width, F expert width.

Every rank writes the shards it holds; DCP's metadata records each shard's offset in the global
tensor, so a checkpoint written on one layout or world size loads into any other (and into
one process, where every tensor is whole). FSDP2 already describes dense weights as DTensors
of their global shape. An expert-parallel rank's expert weights are an FSDP2 DTensor of shape
[L, ...] that does not know about the expert split; :func:`sharded_state` re-describes them
(same storage, no copy) as DTensors of shape [E, ...] on the layer's full mesh, split on dim 0
over ``ep`` (FSDP2 shards experts on dim 1, so the two splits never nest). Adam's moments of
those weights get the same treatment. Loading writes into the model's and optimizer's own
tensors in place.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moe.parallel.state import expert_parallel_layers

SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""DCP warns on every single-process save and load that it assumes one process: it does."""


def _ep_mesh(layer: nn.Module, device_type: str) -> DeviceMesh:
    """The mesh an expert-parallel layer's experts are split over: the full mesh the layer was
    given (with an ``ep`` dim), else a 1-D mesh over its group."""
    ep = layer.expert_parallel
    if ep.mesh is not None:
        return ep.mesh
    return DeviceMesh.from_group(ep.group, device_type, mesh_dim_names=("ep",))


def _global_expert_tensor(t: Tensor, num_experts: int, mesh: DeviceMesh) -> DTensor:
    """This rank's [L, ...] block of an expert tensor (plain or an FSDP2 DTensor on a sub-mesh
    of ``mesh``) as a DTensor of shape [E, ...] on ``mesh``, sharing ``t``'s storage."""
    own = dict(zip(t.device_mesh.mesh_dim_names, t.placements)) if isinstance(t, DTensor) else {}
    local = t.to_local() if isinstance(t, DTensor) else t
    placements = [Shard(0) if name == "ep" else own.get(name, Replicate()) for name in mesh.mesh_dim_names]
    shape = torch.Size([num_experts, *t.shape[1:]])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(state to hand to ``dcp.save`` / ``dcp.load``, the optimizer state dict it views).

    The first has ``"model"`` (the model's state dict) and ``"optimizer"`` (FQN-keyed, from
    ``get_optimizer_state_dict``), expert-parallel tensors re-described with their global
    [E, ...] shape; every tensor shares storage with the model, the optimizer or the second
    dict, so ``dcp.load`` into it restores them in place."""
    model_state = model.state_dict()
    optim_state = get_optimizer_state_dict(model, optimizer)
    model_view = dict(model_state)
    optim_view = {**optim_state, "state": dict(optim_state["state"])}
    for name, layer in expert_parallel_layers(model).items():
        device_type = next(layer.experts.parameters()).device.type
        mesh = _ep_mesh(layer, device_type)
        for pname, _ in layer.experts.named_parameters():
            key = f"{name}.experts.{pname}" if name else f"experts.{pname}"
            model_view[key] = _global_expert_tensor(model_state[key], layer.num_experts, mesh)
            entry = optim_state["state"].get(key)
            if entry is not None:
                optim_view["state"][key] = {
                    k: _global_expert_tensor(v, layer.num_experts, mesh)
                    if isinstance(v, Tensor) and v.dim() > 0 and v.shape == model_state[key].shape
                    else v
                    for k, v in entry.items()
                }
    return {"model": model_view, "optimizer": optim_view}, optim_state


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of model and optimizer into the directory ``path`` (a
    collective; one process works without a process group)."""
    state, _ = sharded_state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore model and optimizer from a checkpoint directory written by :func:`save_sharded`
    on any layout or number of processes (a collective)."""
    state, optim_state = sharded_state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_optimizer_state_dict(model, optimizer, optim_state)
