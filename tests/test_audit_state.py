"""State a target changes inside its forward: buffers and generators reset before every forward;
state outside buffers that makes identical calls differ is reported, never called a leak.

The targets are DeepSeek-V3-style loss-free-balancing routers written from its description
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.1.2; Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing"): sigmoid affinities, top-2 chosen by affinity + a per-expert
bias, weights from the affinities alone; here the bias update is done inside the training
forward (bias += u * sign(mean load - load)), so the new bias acts from the next call on. Within
one call the routing of a token reads that token only: causal, batch-invariant, decode-consistent.

Shapes: B=4, T=16, D=16, E=4.
"""

from __future__ import annotations

import random

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit
from moe.audit.cli import exit_code

B, T, D, E = 4, 16, 16, 4
BIAS_STEP = 0.1
"""u: the bias update speed."""


class LossFreeBalancing(nn.Module):
    """x [B, T, D] -> dense top-2 weights [B, T, E]; the bias lives in a buffer, or (``in_buffer``
    False) in a plain tensor attribute, where no ``state_dict`` (and no audit reset) sees it."""

    def __init__(self, in_buffer: bool = True) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, D, generator=torch.Generator().manual_seed(0)))
        if in_buffer:
            self.register_buffer("bias", torch.zeros(E))
        else:
            self.bias = torch.zeros(E)

    def forward(self, x_BTD: Tensor) -> Tensor:
        s_BTE = torch.sigmoid(x_BTD @ self.gate.T)
        top_BTK = (s_BTE + self.bias).topk(2, dim=-1).indices
        w_BTE = torch.zeros_like(s_BTE).scatter(-1, top_BTK, s_BTE.gather(-1, top_BTK))
        w_BTE = w_BTE / w_BTE.sum(-1, keepdim=True)
        if self.training:
            with torch.no_grad():
                load_E = (w_BTE > 0).float().sum(dim=(0, 1))
                self.bias += BIAS_STEP * torch.sign(load_E.mean() - load_E)
        return w_BTE


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_the_bias_drifts_between_calls_and_not_within_one():
    """The reference, without the audit: two training calls on the same input differ (the bias
    moved); with the bias put back before each, a changed future leaves the past alone."""
    router, x = LossFreeBalancing().train(), example()
    first, second = router(x), router(x)
    assert not torch.equal(first, second), "the bias update must change the next call"
    y = x.clone()
    y[:, 8:] = torch.randn(B, T - 8, D, generator=torch.Generator().manual_seed(1))
    router.bias.zero_()
    a = router(x)
    router.bias.zero_()
    b = router(y)
    assert torch.equal(a[:, :8], b[:, :8])


def test_a_bias_updated_in_the_forward_is_no_leak():
    router = LossFreeBalancing().train()
    report = audit(router, example(), name="loss-free balancing")
    assert report.leaks_in == [] and report.batch_invariant and report.decode_consistent, report.summary()
    assert report.regimes == {"train": "deterministic", "eval": "deterministic"}, report.summary()
    assert report.updated_buffers == ["bias"], report.summary()
    summary = report.summary()
    assert "state: its forward updates bias" in summary and "mechanism:" not in summary, summary
    assert torch.equal(router.bias, torch.zeros(E)), "the audit leaves the buffer as it found it"


def test_state_outside_buffers_is_stateful_not_a_leak():
    """Its training forward moves a plain attribute: train mode is not audited, with why; eval
    mode, which leaves it alone, still is (clean), and the verdict is no "clean" for the target."""
    report = audit(LossFreeBalancing(in_buffer=False), example(), name="bias outside buffers")
    assert report.error is None and report.audited_modes == ["eval"] and not report.leaks_in, report.summary()
    assert report.verdict == "NOT AUDITED in train mode", report.summary()
    why = report.modes_not_audited["train"]
    assert why.startswith("two identical calls differ by "), why
    assert why.endswith(": the target is stateful (its forward changes bias outside its buffers) in train mode")
    assert {p.mode for p in report.probes} == {"eval"} and report.claimed_causal is None
    assert "train mode: NOT AUDITED: two identical calls differ" in report.summary(), report.summary()
    assert report.to_dict()["modes_not_audited"] == {"train": why}
    assert exit_code([report], user_target=True) == 2
    only_train = audit(LossFreeBalancing(in_buffer=False), example(), modes=("train",))
    assert only_train.verdict == "NOT AUDITED" and only_train.error == only_train.modes_not_audited["train"]


class OwnRandomness(nn.Module):
    """Routing jitter from a generator of its own and a Python ``random`` draw: both reset (seeded)
    before every forward like torch's, so the target repeats itself under one seed and is judged
    exactly at the example's shape (the seeded regime)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, D, generator=torch.Generator().manual_seed(0)))
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x_BTD: Tensor) -> Tensor:
        jitter = (0.9 + 0.2 * torch.rand(x_BTD.shape, generator=self.gen)) * random.uniform(0.9, 1.1)
        return (x_BTD * jitter @ self.gate.T).softmax(-1)


def test_own_generators_are_seeded_not_mistaken_for_state():
    target = OwnRandomness()
    state, python_state = target.gen.get_state(), random.getstate()
    report = audit(target, example(), name="own randomness")
    assert report.error is None and report.leaks_in == [], report.summary()
    # Seeded per forward, it repeats itself under one seed: judged exactly, not by distribution.
    assert report.regimes == {"train": "seeded", "eval": "seeded"}, report.summary()
    assert report.probe("random_future", "eval").regime == "seeded", report.summary()
    assert torch.equal(target.gen.get_state(), state) and random.getstate() == python_state
