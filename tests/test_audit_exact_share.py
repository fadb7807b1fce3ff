"""Integer and bool outputs that leak get a figure: the share of their entries that changed. On
7dc4c10 such a probe reported ``excess: 0.0`` beside ``leaks: true`` (excess is a float figure).

Shapes: B=4, T=16, D=8, E=4.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit
from moe.audit.probes import Probe

B, T, D, E = 4, 16, 8, 4


class LastTokenSwitch(nn.Module):
    """Returns, per position, whether the sequence's last token has a positive first feature (a
    bool [B, T]): every earlier position reads the last one."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[:, -1:, 0] > 0).expand(-1, x.shape[1])


class ExpertChoiceIds(nn.Module):
    """Expert ids [B, T] (int64) of expert-choice routing: each expert takes its top T / E tokens
    of the sequence, a token keeps the first expert that took it (E where none did)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(D, E, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        top_BEC = self.gate(x).softmax(1).transpose(1, 2).topk(t // E, dim=-1).indices
        ids_BT = torch.full((b, t), E, dtype=torch.long)
        for e in reversed(range(E)):
            ids_BT.scatter_(1, top_BEC[:, e], e)
        return ids_BT


def _last_resampled(ctx):
    yield ctx.with_future(ctx.t - 2, -ctx.x[:, -1:], "the last position negated")


def test_the_share_of_changed_entries_is_reported():
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    probe = Probe("last_negated", "future", variants=_last_resampled)
    report = audit(LastTokenSwitch(), x, modes=("eval",), probes=[probe])
    result = report.probe("last_negated", "eval")
    flipped = float(((x[:, -1, 0] > 0) != (-x[:, -1, 0] > 0)).float().mean())  # every sample's sign flips
    assert result.leaks and result.changed_share == pytest.approx(flipped), result
    data = json.loads(report.to_json())["targets"][0]["probes"][0]
    assert data["changed_share"] == pytest.approx(flipped) and data["excess"] == 0.0, data


def test_integer_routing_ids_that_leak_have_a_share_and_causal_ones_zero():
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    leaky = audit(ExpertChoiceIds(), x, modes=("eval",)).probe("random_future", "eval")
    assert leaky.leaks and 0 < leaky.changed_share < 1, leaky
    causal = audit(lambda x: (x[..., 0] > 0).long(), x, modes=("eval",)).probe("random_future", "eval")
    assert not causal.leaks and causal.changed_share == 0.0, causal
