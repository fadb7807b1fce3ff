"""The router study's one-factor controls of Expert Threshold routing (issue 54): ``ec_threshold``'s
``normalize`` (each token's weights over its own experts, top-k's form) against a per-token
float64 loop, outputs and gradients; top-k with ``normalize=False`` weighs as Expert Threshold
does (the softmax over all experts, unrenormalised); the defaults are unchanged."""

from __future__ import annotations

import torch
from helpers import identity_router


def reference_weights(logits_NE: torch.Tensor, threshold_E: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The dense [N, E] combine weights, one token at a time: the softmax over all experts, kept
    where it reaches the expert's threshold, divided by the kept ones' sum if ``normalize``."""
    rows = []
    for logit_E in logits_NE:
        p_E = torch.exp(logit_E) / torch.exp(logit_E).sum()
        kept = [float(p_E[e]) >= float(threshold_E[e]) for e in range(len(p_E))]
        mass = sum(p_E[e] for e in range(len(p_E)) if kept[e]) if normalize else 1.0
        rows.append(torch.stack([p_E[e] / (mass + 1e-20) if kept[e] else p_E[e] * 0 for e in range(len(p_E))]))
    return torch.stack(rows)


def threshold_router(normalize: bool | None):
    options = {} if normalize is None else {"normalize": normalize}
    r = identity_router("ec_threshold", 4, statistic="population", aux_loss_coef=0.0, **options)
    with torch.no_grad():  # thresholds as if learned: one expert takes most tokens, one nearly none
        r.ema_sum.copy_(torch.tensor([0.2, 0.3, 0.9, 0.25], dtype=torch.float64))
        r.ema_weight.fill_(1.0)
    return r.eval()


def test_ec_threshold_normalize_divides_each_tokens_weights_by_their_sum_over_its_experts():
    torch.manual_seed(0)
    x_BTE = torch.randn(2, 5, 4, dtype=torch.float64) * 1.5
    x_BTE[0, 0] = torch.tensor([0.19, 0.29, 0.28, 0.24]).log()  # each score below its threshold: no expert
    x_BTE[0, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0])  # 0.25 each: experts 0 and 3 only
    for normalize in (False, True):
        x = x_BTE.clone().requires_grad_(True)
        dense = threshold_router(normalize)(x).dense()
        xr = x_BTE.clone().requires_grad_(True)
        expected = reference_weights(xr.reshape(-1, 4), threshold_router(normalize).threshold, normalize)
        assert torch.allclose(dense.reshape(-1, 4), expected, rtol=0, atol=1e-14), (normalize, dense, expected)
        c = torch.randn(2, 5, 4, dtype=torch.float64)
        (grad,) = torch.autograd.grad((dense * c).sum(), x)
        (grad_ref,) = torch.autograd.grad((expected.reshape(2, 5, 4) * c).sum(), xr)
        diff = (grad - grad_ref).abs()
        assert torch.allclose(grad, grad_ref, rtol=0, atol=1e-13), (normalize, diff.max(), diff.mean())
    kept = threshold_router(True)(x_BTE).dense()
    sums = kept.sum(-1)
    assert sums[0, 0] == 0 and torch.allclose(sums[sums > 0], torch.ones_like(sums[sums > 0]), atol=1e-15)
    assert torch.equal(kept[0, 1], torch.tensor([0.5, 0.0, 0.0, 0.5], dtype=torch.float64))


def test_ec_threshold_defaults_weigh_by_the_score_itself():
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    default, unnormalised = threshold_router(None)(x).dense(), threshold_router(False)(x).dense()
    assert torch.equal(default, unnormalised)
    expected = reference_weights(x[0], threshold_router(None).threshold, False).unsqueeze(0)
    assert torch.allclose(default, expected, rtol=0, atol=1e-15)


def test_topk_unnormalised_weighs_as_expert_threshold_does():
    x = torch.randn(1, 7, 4, dtype=torch.float64)
    r = identity_router("topk", 4, top_k=2, normalize=False, aux_loss_coef=0.0, balance_rate=1e-3)
    dense = r(x).dense()[0]
    p = torch.softmax(x[0], -1)
    top = torch.topk(p, 2, dim=-1).indices
    expected = torch.zeros_like(p).scatter(1, top, p.gather(1, top))
    assert torch.equal(dense, expected) and bool((dense.sum(-1) < 1).all())
