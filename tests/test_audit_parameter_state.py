"""A forward that updates a parameter in place (a loss-free balancing bias kept as an
``nn.Parameter(requires_grad=False)`` and moved inside forward, one way to write DeepSeek-V3's
bias update) is state, as the same bias in a buffer is: the audit restores the parameter before
every forward once it sees a forward change it, names it on the report's ``state:`` line, and
leaves the target's parameters as they were after the audit.

Shapes: B=2, T=16, D=16, E=4.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from moe.audit import audit


class BiasRouter(nn.Module):
    """Top-1 of logits + bias, the token's own expert applied; in the modes listed in ``updates``
    every forward raises the bias of the experts loaded below the mean (sign rule, rate 0.05)."""

    def __init__(self, as_buffer: bool, updates: tuple[str, ...] = ("train",)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.updates = updates
        self.gate = nn.Linear(16, 4, bias=False)
        self.w = nn.Parameter(torch.randn(4, 16, 16) / 4)
        if as_buffer:
            self.register_buffer("bias", torch.zeros(4))
        else:
            self.bias = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.gate(x)
        idx = (logits + self.bias).argmax(-1)
        out = torch.einsum("btd,btde->bte", x, self.w[idx]) * torch.sigmoid(logits.gather(-1, idx[..., None]))
        if ("train" if self.training else "eval") in self.updates:
            load = torch.bincount(idx.flatten(), minlength=4).float()
            self.bias.data += 0.05 * torch.sign(load.mean() - load)
        return out


def example() -> Tensor:
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "parameter"])
def test_a_bias_updated_in_forward_is_state_whether_buffer_or_parameter(as_buffer):
    router = BiasRouter(as_buffer)
    report = audit(router, example())
    assert not report.leaks and not report.modes_not_audited, report.summary()
    assert report.batch_invariant is True  # the batch's loads move the bias after it is used
    named = report.updated_buffers if as_buffer else report.updated_parameters
    assert named == ["bias"]
    assert "state: its forward updates " + ("bias (buffer)" if as_buffer else "bias (parameter)") in report.summary()
    assert torch.equal(router.bias, torch.zeros(4))  # as before the audit


def test_a_parameter_moved_by_the_timing_forwards_of_eval_mode_is_restored_before_calibration():
    router = BiasRouter(as_buffer=False, updates=("eval",))
    report = audit(router, example(), modes=("eval",))
    assert not report.leaks and not report.modes_not_audited, report.summary()
    assert report.updated_parameters == ["bias"]
    assert report.noise_floors == {"eval": 0.0}
