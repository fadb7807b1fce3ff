"""``moe.parallel.clip_grad_norm_`` on one process against the definition, in float64 by hand:
the norm is sqrt(sum of every counted gradient entry squared), every gradient is scaled by
min(1, max_norm / norm), ``uncounted`` parameters are scaled but not counted, and a zero
gradient stays zero.
"""

import math

import torch
from torch import nn

from moe.parallel import clip_grad_norm_


def model_with_grads(scale: float = 1.0) -> tuple[nn.Module, list[torch.Tensor]]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = scale * torch.randn(p.shape, generator=gen)
    return model, [p.grad.clone() for p in model.parameters()]


def hand_norm(grads) -> float:
    return math.sqrt(sum(float(x) ** 2 for g in grads for x in g.double().flatten()))


def test_the_norm_is_that_of_every_gradient_and_large_ones_are_scaled_to_max_norm():
    model, before = model_with_grads(scale=3.0)
    want = hand_norm(before)
    assert want > 1.0
    norm = clip_grad_norm_(model, 1.0)
    assert abs(float(norm) - want) < 1e-5 * want
    coef = 1.0 / (want + 1e-6)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad.double(), g.double() * coef, atol=1e-6, rtol=1e-5)
    assert abs(hand_norm([p.grad for p in model.parameters()]) - 1.0) < 1e-5


def test_gradients_below_max_norm_are_left_as_they_are():
    model, before = model_with_grads(scale=0.01)
    assert hand_norm(before) < 1.0
    clip_grad_norm_(model, 1.0)
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)


def test_infinite_max_norm_only_measures():
    model, before = model_with_grads(scale=5.0)
    norm = clip_grad_norm_(model, float("inf"))
    assert abs(float(norm) - hand_norm(before)) < 1e-5 * hand_norm(before)
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)


def test_a_zero_gradient_stays_zero():
    model, _ = model_with_grads()
    for p in model.parameters():
        p.grad.zero_()
    assert float(clip_grad_norm_(model, 1.0)) == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_uncounted_parameters_are_scaled_but_not_counted():
    model, before = model_with_grads(scale=3.0)
    params = list(model.parameters())
    counted = hand_norm(before[1:])
    norm = clip_grad_norm_(model, 1.0, uncounted=(params[0],))
    assert abs(float(norm) - counted) < 1e-5 * counted
    coef = 1.0 / (counted + 1e-6)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad.double(), g.double() * coef, atol=1e-6, rtol=1e-5)


def test_the_scale_has_torchs_epsilon_where_it_matters():
    """torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6): for a norm of order
    1e-6 that epsilon halves the step, and a sharded run must scale as one process would."""
    model, before = model_with_grads(scale=1e-6)
    reference, _ = model_with_grads(scale=1e-6)
    norm = hand_norm(before)
    max_norm = norm / 2
    clip_grad_norm_(model, max_norm)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    coef = max_norm / (norm + 1e-6)
    assert coef < 0.45  # the epsilon matters: without it the factor would be 0.5
    for p, q, g in zip(model.parameters(), reference.parameters(), before):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=1e-5)
        torch.testing.assert_close(p.grad.double(), g.double() * coef, atol=0, rtol=1e-5)
