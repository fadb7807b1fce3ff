"""Low-precision gradient reduction under FSDP2, measured against fp32 on the same step.

FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` reduces in bf16 but keeps no
fp32 result to compare with. :class:`MeasuredReduceScatter` is FSDP2's reduce-scatter
instead (``FSDPModule.set_custom_reduce_scatter``): the policy hands it fp32 gradients, it
applies the reduction in the low precision (inputs cast, sum in that dtype, result cast back:
what ``reduce_dtype`` would have done) and, on the same inputs, runs the fp32 reduction too,
accumulating the difference. :meth:`MeasuredReduceScatter.pop` returns, over every FSDP unit
and every rank, ``grad_reduce_rel_diff`` = ||g_low - g_fp32|| / ||g_fp32|| and
``grad_reduce_max_abs_diff`` of the reduce-scatter outputs (before any division FSDP2 applies
afterwards, e.g. with forced sum reductions on gloo), the same keys the hand-built path
(``moe.parallel.reduce_gradients``) reports. It costs a second reduce-scatter: a measurement
option, not a speed one. Under HSDP only the reduce-scatter part is in low precision; the
replicate all-reduce runs in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # an FSDP2 without custom reduce-scatter hooks
    ReduceScatter = None


def measured_reduce_supported() -> bool:
    """Whether this torch's FSDP2 accepts a custom reduce-scatter."""
    return ReduceScatter is not None and hasattr(FSDPModule, "set_custom_reduce_scatter")


class MeasuredReduceScatter(ReduceScatter or object):
    """FSDP2's reduce-scatter in ``dtype``, with its difference from fp32 accumulated (module
    docstring). Install with :meth:`install`; read (and reset) with :meth:`pop`."""

    def __init__(self, dtype: torch.dtype) -> None:
        if not measured_reduce_supported():
            raise RuntimeError(
                "this torch's FSDP2 has no set_custom_reduce_scatter: the low-precision "
                "reduction cannot be measured against fp32"
            )
        self.dtype = dtype
        self._sums: Tensor | None = None
        """float64 [3]: sum of squared differences, sum of squared fp32 results, max |difference|."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op, async_op: bool = False
    ) -> None:
        reference = torch.empty_like(output_tensor)
        dist.reduce_scatter_tensor(reference, input_tensor, op=op, group=group)
        low = torch.empty(output_tensor.shape, dtype=self.dtype, device=output_tensor.device)
        dist.reduce_scatter_tensor(low, input_tensor.to(self.dtype), op=op, group=group)
        output_tensor.copy_(low)
        diff = output_tensor.double() - reference.double()
        if self._sums is None:
            self._sums = torch.zeros(3, dtype=torch.float64, device=output_tensor.device)
        self._sums[0] += diff.square().sum()
        self._sums[1] += reference.double().square().sum()
        if diff.numel():
            self._sums[2] = torch.maximum(self._sums[2], diff.abs().max())
        return None

    def install(self, model: nn.Module) -> None:
        """Make every FSDP2 unit of ``model`` reduce-scatter through this object; the units'
        ``MixedPrecisionPolicy`` must reduce in fp32 (this object applies ``dtype``)."""
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ValueError("model has no FSDP2 unit: apply fully_shard first")
        for unit in units:
            unit.set_custom_reduce_scatter(self)

    def pop(self, device: torch.device, group=None) -> dict[str, float]:
        """The difference since the last call, over every rank of ``group`` (collective:
        every rank calls it), then reset. Empty when no reduce-scatter ran on any rank."""
        sums = self._sums if self._sums is not None else torch.zeros(3, dtype=torch.float64, device=device)
        self._sums = None
        totals = sums[:2].clone()
        worst = sums[2:].clone()
        dist.all_reduce(totals, group=group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        if totals[1] == 0:
            return {}
        return {
            "grad_reduce_rel_diff": float(totals[0].sqrt() / totals[1].sqrt()),
            "grad_reduce_max_abs_diff": float(worst[0]),
        }
