"""A leak that reaches a sample only through the other samples' later positions is told apart
from one through its own.

Found on hpcaitech/ColossalAI's ``Top1Router`` with its "first" policy: slots are a cumsum over
the flattened rows b * T + t, so sample 1 queues behind all of sample 0, its later positions
included, while a sample's own future never moves it. The audit said LEAKS (right: at batched
decoding those later positions of sample 0 do not exist yet) but not how; now it resamples one
sample's later positions at a time and says that its own alone moved nothing.

Shapes: B=2, T=16, D=8, E=4, capacity 3 slots per expert over the whole batch.
"""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit
from moe.routers import build_router

B, T, D, E, SLOTS = 2, 16, 8, 4, 5


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


class SampleMajorQueue(nn.Module):
    """Top-1 routing whose expert slots go to the rows of ``x.view(B * T, D)`` in order: a row
    beyond SLOTS of its expert is dropped (output 0)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate = nn.Parameter(torch.randn(D, E, generator=gen))
        self.experts = nn.Parameter(torch.randn(E, D, D, generator=gen) / D**0.5)

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d)
        expert_N = (x_ND @ self.gate).argmax(-1)
        onehot_NE = nn.functional.one_hot(expert_N, E)
        slot_N = ((onehot_NE.cumsum(0) - 1) * onehot_NE).sum(-1)
        y_ND = torch.einsum("nd,nde->ne", x_ND, self.experts[expert_N]) * (slot_N < SLOTS)[:, None]
        return y_ND.view(b, t, d)


def test_a_queue_over_the_flattened_batch_leaks_through_other_samples_only():
    report = audit(SampleMajorQueue(), example(), modes=("eval",))
    assert report.leaks_in == ["eval"] and not report.batch_invariant, report.summary()
    counts = report.own_future["eval"]
    assert counts["own_alone"] == 0 and counts["moved"] >= 3 and report.across_samples_in == ["eval"], counts
    line = f"through other samples (eval): of the {counts['moved']} random futures that moved a sample's earlier"
    assert line in report.summary(), report.summary()
    assert report.to_dict()["own_future"] == {"eval": counts}


def test_a_sample_that_leaks_through_its_own_future_is_not_called_so():
    """Capacity kept by score over the whole batch, called as an opaque function (a target with
    claims names its mechanism instead): a sample's own later, higher-scoring tokens take its
    earlier tokens' slots too."""
    torch.manual_seed(0)
    router = build_router("capacity", d_model=32, num_experts=E, capacity_factor=1.0, priority="score", group="batch")
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(0))
    assert audit(router, x, modes=("eval",)).own_future == {}  # it declares its claims
    report = audit(lambda x_BTD: router(x_BTD).dense(), x, modes=("eval",))
    assert report.leaks and not report.batch_invariant, report.summary()
    counts = report.own_future["eval"]
    assert counts["own_alone"] > 0 and report.across_samples_in == [], counts
    assert "through other samples" not in report.summary()


def test_a_batch_invariant_leak_is_not_checked_again():
    x = example()
    report = audit(lambda x_BTD: x_BTD + x_BTD.mean(1, keepdim=True), x, modes=("eval",))
    assert report.leaks and report.batch_invariant and report.own_future == {}, report.summary()


def test_too_few_moved_futures_decide_nothing():
    from moe.audit.report import OWN_FUTURE_LEAST, AuditReport

    report = AuditReport("t", ("train", "eval"), None)
    report.own_future = {
        "train": {"moved": OWN_FUTURE_LEAST - 1, "own_alone": 0},
        "eval": {"moved": OWN_FUTURE_LEAST, "own_alone": 0},
    }
    assert report.across_samples_in == ["eval"]
    report.own_future["eval"]["own_alone"] = 1
    assert report.across_samples_in == []
