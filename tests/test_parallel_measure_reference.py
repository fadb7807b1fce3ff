"""What the default tests leave open in two parallel helpers, each against a float64 reference
written here: the bf16 gradient reduce-scatter measured against fp32 (its output is the bf16
reduction, its figures ||g_bf16 - g_fp32|| / ||g_fp32|| and max |g_bf16 - g_fp32| over every
call), on one gloo process, where a reduce-scatter is the identity; and the simulator's buffer
averaging, a mean over the P workers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe.parallel.lossy.data_parallel import LossyDPConfig
from moe.parallel.lossy.simulated import SimulatedDataParallel
from moe.parallel.reduce_precision import MeasuredReduceScatter, measured_reduce_supported


@pytest.mark.skipif(not measured_reduce_supported(), reason="this torch's FSDP2 has no custom reduce-scatter")
@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.* is deprecated:FutureWarning")
def test_bf16_reduce_scatter_is_applied_and_measured_against_fp32(world_of_one):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(40, generator=gen) / 3, torch.randn(24, generator=gen) * 5]
    measure = MeasuredReduceScatter(torch.bfloat16)
    for x in inputs:
        out = torch.empty_like(x)
        measure(out, x, world_of_one, dist.ReduceOp.SUM)
        assert torch.equal(out, x.to(torch.bfloat16).float())  # one rank's sum, rounded to bf16
    diff = torch.cat([x.to(torch.bfloat16).double() - x.double() for x in inputs])
    exact = torch.cat([x.double() for x in inputs])
    figures = measure.pop(torch.device("cpu"), world_of_one)
    assert figures["grad_reduce_rel_diff"] == pytest.approx(float(diff.norm() / exact.norm()), rel=1e-12)
    assert figures["grad_reduce_max_abs_diff"] == pytest.approx(float(diff.abs().max()), rel=1e-12)
    assert 1e-4 < figures["grad_reduce_rel_diff"] < 1e-2  # bf16 keeps 8 bits of mantissa
    assert measure.pop(torch.device("cpu"), world_of_one) == {}  # reset by the pop


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_buffer("stat", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_average_buffers_is_the_mean_over_the_workers():
    """Four workers whose floating buffer is (i, 10 i): every replica gets (1.5, 15); the integer
    buffer is left as it is."""
    sim = SimulatedDataParallel(WithBuffers(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), LossyDPConfig(), 4)
    for i, replica in enumerate(sim.replicas):
        replica.stat.copy_(torch.tensor([i, 10.0 * i], dtype=torch.float64))
        replica.steps.fill_(i)
    sim.average_buffers(lambda m: isinstance(m, WithBuffers))
    assert [r.stat.tolist() for r in sim.replicas] == [[1.5, 15.0]] * 4
    assert [int(r.steps) for r in sim.replicas] == [0, 1, 2, 3]
