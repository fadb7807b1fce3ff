"""Expert parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs, torchrun).

    import torch.distributed as dist
    from moe import MoELayer
    from moe.parallel import ExpertParallel, load_full_state_dict, reduce_gradients

    dist.init_process_group("gloo")                       # under torchrun
    layer = MoELayer(512, 1024, 8, router="topk", expert_parallel=ExpertParallel(dist.group.WORLD))
    load_full_state_dict(layer, single_process_layer.state_dict())
    y_BTD = layer(x_BTD)                                  # x_BTD: this rank's own tokens
    loss.backward(); reduce_gradients(layer)              # before the optimiser step

See :mod:`moe.parallel.exchange` for the data path, :mod:`moe.parallel.state` for
single-process state dicts (model and optimizer), gradient scaling and clipping,
:mod:`moe.parallel.mesh` for the DeviceMesh (replicate x FSDP2 shard x expert parallel) and
:mod:`moe.parallel.sharded_state` for sharded DCP checkpoints. ``moe.training`` runs every
layout under ``--dp-replicate R --expert-parallel P``.
"""

from moe.parallel.exchange import (
    ExpertParallel,
    all_to_all_rows,
    exchange_counts,
    expert_parallel_ffn,
    group_rank_size,
    local_expert_range,
)
from moe.parallel.state import (
    clip_grad_norm_,
    expert_parallel_layers,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    rank_state_bytes,
    reduce_gradients,
    shard_state_dict,
    share_router_statistics,
    split_parameters,
)
from moe.parallel.timing import PhaseTimer

__all__ = [
    "ExpertParallel",
    "PhaseTimer",
    "all_to_all_rows",
    "clip_grad_norm_",
    "exchange_counts",
    "expert_parallel_ffn",
    "expert_parallel_layers",
    "full_optimizer_state_dict",
    "full_state_dict",
    "group_rank_size",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "local_expert_range",
    "rank_state_bytes",
    "reduce_gradients",
    "shard_state_dict",
    "share_router_statistics",
    "split_parameters",
]
