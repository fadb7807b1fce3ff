"""Parameters, gradients, router state and checkpoints of an expert-parallel model.

Two kinds of parameters:

* **expert parameters** (``experts.w_gate / w_up / w_down`` of every ``MoELayer`` given an
  ``ExpertParallel``): sharded, rank r holds experts [r*L, (r+1)*L). Their gradients already
  hold every rank's tokens (the backward of the exchange brings them home), so they are
  never all-reduced.
* **replicated parameters** (everything else: embeddings, attention, norms, routers):
  identical on every rank, trained data-parallel, gradients averaged over the group.

Scaling. Rank r computes ``loss_r``, the mean over its own tokens; with equal shards the
single-process loss is ``mean_r loss_r``. Its gradient for a replicated parameter is the
average of the ranks' gradients (all-reduce, divide by P). For an expert parameter, the
local ``.grad`` after ``loss_r.backward()`` on every rank is ``sum_r d loss_r / dW``, the sum
over all ranks' tokens that reached this expert; the single-process gradient is that sum
divided by P, with no communication. :func:`reduce_gradients` does both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from moe.parallel.exchange import ExpertParallel, group_rank_size, guarded


def expert_parallel_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> every module of ``model`` given an :class:`ExpertParallel` (its experts are
    sharded over that object's group): found by the injected object, not by class."""
    return {
        name: m for name, m in model.named_modules() if isinstance(getattr(m, "expert_parallel", None), ExpertParallel)
    }


def share_router_statistics(model: nn.Module, group=None) -> None:
    """Make every router of ``model`` count its load-balancing loss's assignment fractions
    over ``group`` (``Router.context.stats_group``): each rank's aux loss is then
    ``coef * E * sum_e f_e(global) * P_e(local)``, whose mean over equal shards is the
    single-process loss in value and gradient. Routing itself stays on the rank's own tokens."""
    from moe.routing import Router

    for module in model.modules():
        if isinstance(module, Router):
            module.context.stats_group = group


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(expert parameters, replicated parameters) of ``model`` that require gradients, each
    in registration order."""
    expert_ids = {id(p) for layer in expert_parallel_layers(model).values() for p in layer.experts.parameters()}
    expert, replicated = [], []
    for p in model.parameters():
        if p.requires_grad:
            (expert if id(p) in expert_ids else replicated).append(p)
    return expert, replicated


def _expert_keys(model: nn.Module) -> dict[str, nn.Module]:
    """State-dict key of each sharded expert tensor -> the layer that holds it."""
    return {
        f"{name}.experts.{pname}" if name else f"experts.{pname}": layer
        for name, layer in expert_parallel_layers(model).items()
        for pname, _ in layer.experts.named_parameters()
    }


def shard_state_dict(full_state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """This rank's state dict of ``model`` cut from a full single-process state dict: expert
    tensors [E, ...] are sliced to the local block [L, ...], everything else is kept."""
    out = dict(full_state)
    for key, layer in _expert_keys(model).items():
        if key not in full_state:
            raise ValueError(f"full state dict has no {key!r}")
        full = full_state[key]
        if full.shape[0] != layer.num_experts:
            raise ValueError(
                f"{key}: expected {layer.num_experts} experts in the full state dict, got shape {tuple(full.shape)}"
            )
        start, stop = layer.local_experts
        out[key] = full[start:stop]
    return out


def load_full_state_dict(model: nn.Module, full_state: dict[str, Tensor], strict: bool = True):
    """Load a single-process checkpoint into an expert-parallel ``model`` (no communication)."""
    return model.load_state_dict(shard_state_dict(full_state, model), strict=strict)


def _full(t: Tensor) -> Tensor:
    """The whole tensor of an FSDP2 DTensor (a collective on its mesh); a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The single-process state dict of a sharded ``model``: FSDP2 DTensors gathered over their
    mesh, expert-parallel experts all-gathered over their group (collectives: every rank must
    call it), returned on every rank, on the CPU. Loadable by a single-process model or, through
    :func:`load_full_state_dict`, by one on any number of ranks."""
    state = {k: _full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    for key, layer in _expert_keys(model).items():
        local = state[key].to(model.get_parameter(key).device).contiguous()
        _, size = group_rank_size(layer.expert_parallel.group)
        parts = [torch.empty_like(local) for _ in range(size)]
        group = layer.expert_parallel.group
        guarded("state gather", group, lambda: dist.all_gather(parts, local, group=group))
        state[key] = torch.cat(parts).cpu()
    return state


def _flat_grads(params: list[nn.Parameter]) -> Tensor:
    """Every gradient (zeros where missing) in one flat buffer of at least fp32 precision."""
    if not params:
        return torch.zeros(0)
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in params])


def _all_reduce_mean(flat: Tensor, dtype: torch.dtype, group, size: int) -> Tensor:
    buf = flat.to(dtype, copy=True)
    guarded("gradient all-reduce", group, lambda: dist.all_reduce(buf, group=group))
    return buf.to(flat.dtype) / size


@torch.no_grad()
def reduce_gradients(model: nn.Module, group=None, reduce_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Make every gradient the gradient of the mean of the ranks' losses (see the module
    docstring): replicated parameters all-reduced and averaged over ``group``, expert
    parameters divided by the group size. Call after ``backward``, before the optimiser.

    The default reduces in fp32 (in the gradients' own dtype where that is wider, e.g. a
    float64 model). ``reduce_dtype=torch.bfloat16`` sends the replicated gradients in bf16
    and applies that result, to measure the bias low-precision reduction adds; the fp32
    reduction of the same gradients runs too and the returned dict reports the difference:
    ``grad_reduce_rel_diff`` (||g_bf16 - g_fp32|| / ||g_fp32||) and ``grad_reduce_max_abs_diff``.
    With fp32 (the default) the dict is empty. Every rank of ``group`` must call this.
    """
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
    _, size = group_rank_size(group)
    expert, replicated = split_parameters(model)
    for layer in expert_parallel_layers(model).values():
        if group_rank_size(layer.expert_parallel.group)[1] != size:
            raise ValueError("the expert-parallel group must span the data-parallel group (EP size = DP size)")
    for p in expert:
        if p.grad is not None:
            p.grad.div_(size)
    flat = _flat_grads(replicated)
    reduced = _all_reduce_mean(flat, flat.dtype, group, size)
    info: dict[str, float] = {}
    if reduce_dtype != torch.float32:
        low = _all_reduce_mean(flat, reduce_dtype, group, size)
        diff = low - reduced
        info["grad_reduce_rel_diff"] = float(diff.norm() / reduced.norm().clamp_min(1e-30))
        info["grad_reduce_max_abs_diff"] = float(diff.abs().max()) if diff.numel() else 0.0
        reduced = low
    offset = 0
    for p in replicated:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(reduced[offset : offset + n].view_as(p))
        offset += n
    return info


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, pipeline_group=None, uncounted: tuple = ()) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a sharded model: the norm of the *whole* model's
    gradient, so every rank scales by the same factor, the one a single process would use.

    Gradients may be plain tensors or FSDP2 DTensors on any mesh, mixed. Each kind is summed
    where it lives: a DTensor's squared norm over the shard dims of its mesh (replicas counted
    once), an expert-parallel layer's experts additionally over its expert-parallel group,
    and a plain non-expert gradient counts as it is (identical on every rank after reduction).
    With pipeline parallelism ``model`` is one stage: the squared norms of the stages are summed
    over ``pipeline_group``, and ``uncounted`` parameters (a second copy of a weight another
    stage counts, e.g. a tied embedding) are scaled but not counted. Call after the gradients
    are reduced. ``max_norm=inf`` only measures. Returns the norm."""
    owner = {id(p): layer for layer in expert_parallel_layers(model).values() for p in layer.experts.parameters()}
    skip = {id(p) for p in uncounted}
    buckets: dict[tuple, Tensor] = {}
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        grads.append(g)
        if id(p) in skip:
            continue
        layer = owner.get(id(p))
        ep_group = layer.expert_parallel.group if layer is not None else None
        local, placement = (g.to_local(), (g.device_mesh, tuple(g.placements))) if isinstance(g, DTensor) else (g, None)
        key = (placement, ep_group)
        sq = torch.linalg.vector_norm(local.float()).square()
        buckets[key] = buckets[key] + sq if key in buckets else sq
    total_sq = torch.zeros(())
    for (placement, ep_group), sq in buckets.items():
        if placement is not None:
            mesh, placements = placement
            partial = [Partial() if pl.is_shard() else Replicate() for pl in placements]
            sq = DTensor.from_local(sq, mesh, partial, run_check=False).full_tensor()
        if ep_group is not None:
            guarded("gradient-norm all-reduce", ep_group, lambda: dist.all_reduce(sq, group=ep_group))
        total_sq = total_sq + sq.cpu()
    if pipeline_group is not None:
        device = grads[0].device if grads else torch.device("cpu")
        total_sq = total_sq.to(device)
        guarded("gradient-norm all-reduce", pipeline_group, lambda: dist.all_reduce(total_sq, group=pipeline_group))
        total_sq = total_sq.cpu()
    total = total_sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _optimizer_expert_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, nn.Module]:
    """Optimizer state index (as in ``optimizer.state_dict()``) of each sharded expert
    parameter -> its layer."""
    owner = {id(p): layer for layer in expert_parallel_layers(model).values() for p in layer.experts.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: owner[id(p)] for i, p in enumerate(params) if id(p) in owner}


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` as a single process would have it: per-expert state
    tensors (Adam's moments: the shape of the parameter) all-gathered over the expert group.
    A collective, like :func:`full_state_dict`; parameter indices are the same on every rank
    and in a single-process model built from the same config."""
    state = optimizer.state_dict()
    for i, layer in _optimizer_expert_entries(model, optimizer).items():
        _, size = group_rank_size(layer.expert_parallel.group)
        for key, value in state["state"].get(i, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == layer.experts.num_experts:
                local = value.contiguous()
                parts = [torch.empty_like(local) for _ in range(size)]
                guarded(
                    "optimizer-state gather",
                    layer.expert_parallel.group,
                    lambda: dist.all_gather(parts, local, group=layer.expert_parallel.group),
                )
                state["state"][i] = {**state["state"][i], key: torch.cat(parts)}
    return state


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, full_state: dict) -> None:
    """Load a single-process optimizer state (e.g. from :func:`full_optimizer_state_dict`)
    into the optimizer of an expert-parallel ``model``: expert state tensors are sliced."""
    state = {"state": dict(full_state["state"]), "param_groups": full_state["param_groups"]}
    for i, layer in _optimizer_expert_entries(model, optimizer).items():
        start, stop = layer.local_experts
        entry = state["state"].get(i)
        if entry is None:
            continue
        state["state"][i] = {
            k: v[start:stop] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == layer.num_experts else v
            for k, v in entry.items()
        }
    optimizer.load_state_dict(state)


def rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (the local shards of
    DTensors; a tied parameter counted once): ``{"params", "grads", "optimizer", "total"}``."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    params = list(model.parameters())
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            nbytes(v)
            for state in (optimizer.state.values() if optimizer is not None else ())
            for v in state.values()
            if isinstance(v, Tensor)
        ),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
