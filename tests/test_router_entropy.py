"""The trainer's ``router_entropy`` metric (``moe.training.metrics.RouterEntropy``) against a
float64 reference computed from the same logits: the mean over router calls of each call's mean
per-token entropy (nats) of the softmax over experts."""

from __future__ import annotations

import math

import pytest
import torch

from moe.model import MoETransformer, preset
from moe.routing import Router
from moe.training.metrics import RouterEntropy


def reference_entropy(logits: list[torch.Tensor]) -> float:
    per_call = []
    for logits_NE in logits:
        p_NE = logits_NE.double().softmax(-1)
        per_call.append(float(-(p_NE * p_NE.log()).sum(-1).mean()))
    return sum(per_call) / len(per_call)


@pytest.mark.parametrize("num_experts", [3, 8, 33])
def test_entropy_equals_the_float64_reference(num_experts):
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny", num_experts=num_experts, vocab_size=97))
    for m in model.modules():
        if isinstance(m, Router):  # spread the logits: a near-uniform softmax hides little
            torch.nn.init.normal_(m.gate.weight, std=1.0)
    seen: list[torch.Tensor] = []
    hooks = [
        m.gate.register_forward_hook(lambda mod, i, out: seen.append(out.detach().clone()))
        for m in model.modules()
        if isinstance(m, Router)
    ]
    entropy = RouterEntropy(model)
    idx = torch.randint(0, 97, (3, 20))
    model(idx, idx)
    model(idx.flip(1), idx)
    total, count = entropy.pop()
    assert int(count) == len(seen) == 2 * len(hooks)
    assert float(total / count) == pytest.approx(reference_entropy(seen), rel=1e-6)
    assert 0.05 < float(total / count) < math.log(num_experts) - 0.05  # neither one-hot nor uniform
    assert entropy.pop()[1] == 0  # pop starts the count again
    entropy.close()


def test_equal_logits_give_log_num_experts():
    model = MoETransformer(preset("tiny", num_experts=6, vocab_size=50))
    for m in model.modules():
        if isinstance(m, Router):
            torch.nn.init.zeros_(m.gate.weight)
    entropy = RouterEntropy(model)
    idx = torch.randint(0, 50, (2, 9))
    model(idx, idx)
    total, count = entropy.pop()
    assert float(total / count) == pytest.approx(math.log(6), rel=1e-6)
