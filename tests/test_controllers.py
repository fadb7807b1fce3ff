"""The controllers of ReMoE (the L1 coefficient) and top-p (p) when a step holds several training
forwards (microbatches, or a pipeline's microbatches through one stage): each acts on the MEAN
number of experts per token over the step's forwards, not on their sum, nor on one forward
alone; and top-p's controller ignores evaluation forwards.

Every forward below has the same number of tokens, so the mean over forwards is also the mean
over the step's tokens: the tests hold for either reading. Expert counts are set by hand through
a router whose gate is the identity (the input features are the logits); one test goes through
the trainer's microbatched step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_RUN, identity_router

from moe.routers.remoe import ReLURouter
from moe.training import TrainConfig, train

E = 8
TARGET = 2.0


def remoe_forward(counts: list[int]) -> torch.Tensor:
    """One sequence whose token i has exactly ``counts[i]`` positive logits (ReMoE's active experts)."""
    x = -torch.ones(1, len(counts), E, dtype=torch.float64)
    for i, c in enumerate(counts):
        x[0, i, :c] = 1.0
    return x


TOP_P_ROWS = {
    # probabilities whose top-p set at p in [0.45, 0.6) holds exactly k experts (margins >= 0.05)
    1: [0.6] + [0.4 / 7] * 7,  # mass before the 2nd: 0.6
    2: [0.4, 0.3] + [0.3 / 6] * 6,  # before the 2nd 0.4, the 3rd 0.7
    3: [0.2, 0.2, 0.2] + [0.4 / 5] * 5,  # before the 3rd 0.4, the 4th 0.6
    4: [0.15] * 4 + [0.1] * 4,  # before the 4th 0.45, the 5th 0.6
}


def top_p_forward(counts: list[int]) -> torch.Tensor:
    """One sequence whose token i keeps exactly ``counts[i]`` experts under p in [0.45, 0.6)."""
    return torch.tensor([[TOP_P_ROWS[c] for c in counts]], dtype=torch.float64).log()


# Each step: two training forwards of two tokens. Steps 1 and 2 hold the same forwards in both
# orders (so neither the first nor the last forward alone decides), step 3 a mean above the target.
# The sum of the two forwards' means is above the target in every step.
STEPS = [
    ([[4, 1], [1, 1]], -1),  # means 2.5 and 1.0: mean 1.75 < 2 (sum 3.5)
    ([[1, 1], [4, 1]], -1),  # the same, in the other order
    ([[4, 2], [1, 2]], +1),  # means 3.0 and 1.5: mean 2.25 > 2 (sum 4.5)
]


def test_remoe_coefficient_follows_the_mean_of_the_steps_forwards():
    rate, coef = 2.0, 1e-3
    r = identity_router("remoe", E, top_k=TARGET, l1_init=coef, l1_rate=rate).train()
    for forwards, direction in STEPS:
        for counts in forwards:
            out = r(remoe_forward(counts))
            assert out.experts_per_token().tolist() == counts  # the hand case routes as meant
        r.update_after_step()
        coef *= rate**direction  # above the target: times the rate; below: divided by it
        assert float(r.l1_coef) == pytest.approx(coef, rel=1e-12), (forwards, float(r.l1_coef), coef)


def test_top_p_threshold_follows_the_mean_of_the_steps_forwards():
    rate, p = 0.01, 0.5
    r = identity_router("top_p", E, p=p, target_experts=TARGET, p_rate=rate).train()
    for forwards, direction in STEPS:
        for counts in forwards:
            out = r(top_p_forward(counts))
            assert out.experts_per_token().tolist() == counts
        r.update_after_step()
        p -= rate * direction  # more experts than the target lower p, fewer raise it
        assert float(r.p) == pytest.approx(p, abs=1e-12), (forwards, float(r.p), p)


def test_a_step_of_two_microbatches_moves_each_layers_coefficient_by_its_mean():
    """Through the trainer: one step of two microbatches. ReMoE routes each token alone, so the
    step's per-layer mean experts per token (the training record's ``active_experts_layers``,
    counted from the routings) is also the mean over the two microbatches; each layer's
    coefficient must move by the sign of that mean minus the target. The target sits between
    each layer's mean and twice it, so the sum of the two microbatches' means is on the other side."""
    init, rate, target = 1e-3, 2.0, 2.5
    options = {"top_k": target, "l1_rate": rate, "l1_init": init}
    run = train(
        TrainConfig.flat(**{**SMALL_RUN, "steps": 1, "microbatches": 2}, router="remoe", router_options=options)
    )
    means = run.history[0]["active_experts_layers"]
    assert all(target / 2 < m < target for m in means), means  # the case separates mean from sum
    coefs = [float(m.l1_coef) for m in run.model.modules() if isinstance(m, ReLURouter)]
    assert coefs == pytest.approx([init / rate] * len(means), rel=1e-12), (coefs, means)


def test_top_p_controller_ignores_evaluation_forwards():
    """A training forward below the target beside an evaluation forward far above it: p rises, as
    the training forward alone says; an evaluation forward alone (on the other side of the target
    from the last step) leaves p as it is."""
    rate = 0.01
    r = identity_router("top_p", E, p=0.5, target_experts=TARGET, p_rate=rate)
    r.train()(top_p_forward([1, 1]))  # 1 expert per token < 2
    r.eval()(top_p_forward([4, 4, 4, 4]))  # 4 per token: with it, the mean would be above 2
    r.update_after_step()
    assert float(r.p) == pytest.approx(0.5 + rate, abs=1e-12), float(r.p)
    r.eval()(top_p_forward([4, 4]))  # above the target, where the last step was below
    r.update_after_step()
    assert float(r.p) == pytest.approx(0.5 + rate, abs=1e-12), float(r.p)
    # and the step after counts only its own training forwards, not the evaluation before it
    r.train()(top_p_forward([2, 3]))  # 2.5 > 2: p falls back
    r.update_after_step()
    assert float(r.p) == pytest.approx(0.5, abs=1e-12), float(r.p)


def test_top_p_always_keeps_a_tokens_most_probable_expert():
    """The controller never drives p so low that a token keeps no expert (the module's contract:
    the first expert is always kept), even after a step down larger than p itself."""
    r = identity_router("top_p", E, p=0.35, target_experts=1.0, p_rate=0.5).train()
    assert r(top_p_forward([4, 4])).experts_per_token().tolist() == [3, 3]  # masses before: 0, 0.15, 0.3
    r.update_after_step()  # 3 > 1 expert per token: p falls by a step of 0.5
    assert float(r.p) > 0, float(r.p)
    kept = r(top_p_forward([1, 2, 3, 4])).experts_per_token()
    assert bool((kept >= 1).all()), (kept.tolist(), float(r.p))
