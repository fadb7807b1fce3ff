"""The audit puts every buffer of its target back before every forward, in evaluation mode as in
training, and for the forwards of every probe (futures, other batches, decoding prefixes):
state one forward leaves in a buffer never reaches the next one.

The target keeps a running centre of the features it has seen (an exponential moving average
in a buffer, updated by every forward in both modes, as normalisation statistics or a
decoder's token counter are) and subtracts the centre from past calls: within one call, the
output at a position depends on that position alone. If a forward saw the buffer a previous
forward left, a changed future, batch or prefix length would move the output: a false leak.
(tests/test_audit_state.py has a bias updated in training forwards only, from routing loads.)

Shapes: B=4, T=16, D=8. Only the public API: ``audit`` and its report's fields.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.audit import audit

B, T, D = 4, 16, 8


class RunningCentre(nn.Module):
    """y = x @ W - centre; then centre <- 0.5 centre + 0.5 mean of this call's x @ W."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("centre", torch.zeros(D))

    def forward(self, x_BTD: Tensor) -> Tensor:
        h_BTD = x_BTD @ self.w
        y_BTD = h_BTD - self.centre
        with torch.no_grad():
            self.centre.mul_(0.5).add_(0.5 * h_BTD.mean(dim=(0, 1)))
        return y_BTD


def test_a_buffer_every_forward_updates_is_reset_before_each_forward():
    target = RunningCentre()
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    h_BTD = x @ target.w.detach()
    two = target(x), target(x)  # the reference, without the audit: the second call sees the first's centre
    assert torch.equal(two[0], h_BTD) and not torch.allclose(two[0], two[1])
    target.centre.zero_()
    report = audit(target, x, name="running centre")
    assert report.error is None and report.leaks_in == [], report.summary()
    assert report.batch_invariant and report.decode_consistent, report.summary()
    assert report.regimes == {"train": "deterministic", "eval": "deterministic"}, report.summary()
    assert report.updated_buffers == ["centre"], report.summary()
    assert torch.equal(target.centre, torch.zeros(D)), "the audit leaves the buffer as it found it"
