"""``global_batch_loads`` runs its counting forwards only where they are needed: a step of one
forward counts for itself, and a model without a global balance loss counts nothing; a step of
M > 1 forwards runs each once, without gradients, and hands the routers the step's counts."""

from __future__ import annotations

import torch
from helpers import small_lm

from moe.global_balance import global_batch_loads


def counted(model, chunks, calls):
    def forward(c):
        calls.append(torch.is_grad_enabled())
        return model(c)

    return [lambda c=c: forward(c) for c in chunks]


def test_counting_forwards_run_only_for_several_microbatches_with_a_global_loss():
    idx = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    model = small_lm("topk", {"top_k": 2, "global_aux_loss_coef": 1.0})
    router = model.routers()[0]
    calls: list[bool] = []
    with global_batch_loads(model, counted(model, [idx], calls)):
        assert calls == [] and router.context.global_load is None
    with global_batch_loads(model, counted(model, idx.chunk(2), calls)):
        assert calls == [False, False]
        assert float(router.context.global_load.sum()) == 4 * 6 * 2  # every token's k = 2 choices
    assert router.context.global_load is None
    plain = small_lm("topk", {"top_k": 2})
    calls.clear()
    with global_batch_loads(plain, counted(plain, idx.chunk(2), calls)):
        assert calls == []
