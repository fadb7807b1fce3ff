"""Training over a lossy transport (simulated on top of ``torch.distributed``).

    from moe.parallel.lossy import LossConfig, LossyDPConfig, LossyDataParallel

    dp = LossyDataParallel(model, optimizer, LossyDPConfig("unbiased", LossConfig(rate=0.1, seed=0)))
    loss.backward(); metrics = dp.step(step)       # instead of reduce_gradients + optimizer.step()

:mod:`~moe.parallel.lossy.transport`: packets, the loss pattern (a pure function of seed, step,
stream, source, destination and packet), lossy reduce-scatter and all-gather.
:mod:`~moe.parallel.lossy.data_parallel`: the aggregation policies (reliable, unbiased, naive,
reweighted), the bounded-drift parameter broadcast and the drift measurement: one step,
:class:`LossyReplicas`, for one replica per process (:class:`LossyDataParallel`) and for P
replicas in one process (:class:`~moe.parallel.lossy.simulated.SimulatedDataParallel`).
:mod:`~moe.parallel.lossy.expert`: expert-parallel rows lost in the dispatch and return
exchanges and in their gradients.
"""

from moe.parallel.lossy.data_parallel import (
    METRICS,
    POLICIES,
    LossyDataParallel,
    LossyDPConfig,
    LossyReplicas,
    aggregate_gradient,
    replica_spread,
)
from moe.parallel.lossy.simulated import SimulatedDataParallel
from moe.parallel.lossy.transport import LossConfig, LossyTransport, Workers, lost_packets, shard_bounds

__all__ = [
    "METRICS",
    "POLICIES",
    "LossConfig",
    "LossyDPConfig",
    "LossyDataParallel",
    "LossyReplicas",
    "LossyTransport",
    "SimulatedDataParallel",
    "Workers",
    "aggregate_gradient",
    "lost_packets",
    "replica_spread",
    "shard_bounds",
]
