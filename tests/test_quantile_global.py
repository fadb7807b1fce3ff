"""Global-step quantile balancing (router ``quantile_global``; Kimi K3 §2.3.3) in one process:
selection and weights against a per-token float64 reference, the solved bias against the exact
K/E quantile of the step's required biases, the pre-step hook, the claims, the audit both ways,
KV-cache decoding and record / replay. Layouts (gloo ranks, expert parallelism, gradient
accumulation): tests/test_quantile_global_parallel.py."""

from __future__ import annotations

import pytest
import torch
from helpers import identity_router, small_lm
from torch import nn

import moe
from moe.audit import audit
from moe.model import MoETransformer, preset
from moe.routers.quantile_global import register_quantile_balancing_hook

E, K = 8, 2


def required_biases(x_NE: torch.Tensor, bias_E: torch.Tensor, k: int) -> torch.Tensor:
    """float64 [N, E]: alpha_n - s_ne, alpha_n the (k+1)-th largest of s_n + b (written per token)."""
    s = torch.sigmoid(x_NE.double())
    rows = []
    for n in range(s.shape[0]):
        alpha = sorted((s[n] + bias_E.double()).tolist(), reverse=True)[k]
        rows.append([alpha - v for v in s[n].tolist()])
    return torch.tensor(rows, dtype=torch.float64)


def test_selection_and_weights_follow_the_biased_top_k_with_unbiased_scores():
    r = identity_router("quantile_global", 4, top_k=2, route_scale=2.0)
    with torch.no_grad():
        r.balance_bias.copy_(torch.tensor([0.0, 0.0, 0.5, -0.5]))
    x = torch.tensor([[[2.0, 1.0, 0.5, 3.0], [0.0, 0.1, -0.2, 0.3]]], dtype=torch.float64)
    out = r(x)
    s = torch.sigmoid(x[0])
    # token 0: s + b = .881, .731, 1.122, .453 -> experts 2, 0; token 1: .5, .525, .95, .074 -> 2, 1
    want = torch.zeros(2, 4, dtype=torch.float64)
    for n, chosen in enumerate([[2, 0], [2, 1]]):
        for e in chosen:
            want[n, e] = 2.0 * s[n, e] / sum(s[n, c] for c in chosen)
    torch.testing.assert_close(out.dense()[0], want, rtol=1e-12, atol=1e-12)
    assert out.aux_loss > 0 and out.stats["quantile_bias"].tolist() == [0.0, 0.0, 0.5, -0.5]  # z-loss only


def test_solved_bias_is_the_k_over_e_quantile_of_the_required_biases_and_balances_the_batch():
    torch.manual_seed(0)
    n = 4000
    r = identity_router("quantile_global", E, top_k=K)
    with torch.no_grad():
        r.balance_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = torch.randn(1, n, E, dtype=torch.float64) + torch.linspace(0, 2, E, dtype=torch.float64)  # skewed
    skewed = r(x).stats["tokens_per_expert"]
    low, width = (float(v) for v in r.bin_range())
    req = required_biases(x[0], r.balance_bias, K)
    r.update_after_step()
    exact = req.sort(0).values[int(n * K / E) - 1]  # the (N k / E)-th smallest per expert
    exact = exact - exact.mean()
    # the histogram reads each quantile to within one bin (1/1000 of [min b - 1, max b + 1]), so
    # the centred biases to within two
    assert (r.balance_bias.double() - exact).abs().max() <= 2 * width, (r.balance_bias, exact, width)
    assert abs(r.balance_bias.sum().item()) < 1e-5 and low == pytest.approx(-1.2)
    target = n * K / E
    assert (skewed - target).abs().max() > 0.5 * target  # before: far off
    # one update is one step of a dual coordinate descent (every alpha moves with the biases):
    # repeated on the same batch it settles within the histogram's resolution (measured: the
    # worst expert 2,453 tokens off its 1,000 before, 707 after the first update, 39 after ten)
    first = (r(x).stats["tokens_per_expert"] - target).abs().max()
    assert r.histogram_ER.sum() == n * E  # that forward's observations: the first's were emptied
    for _ in range(10):
        r.update_after_step()
        balanced = r(x).stats["tokens_per_expert"]
    assert first < 0.5 * (skewed - target).abs().max() and (balanced - target).abs().max() <= 0.05 * target


def test_eval_and_decoding_record_nothing_and_an_empty_step_keeps_the_bias():
    r = identity_router("quantile_global", 4, top_k=1)
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    r.eval()
    r(x)
    r.train()
    state = r.init_decode_state(2)
    r(x[:, :3], decode_state=state)
    assert r.histogram_ER.sum() == 0
    with torch.no_grad():
        r.balance_bias.copy_(torch.tensor([0.1, -0.1, 0.2, -0.2]))
    r.update_after_step()
    assert r.balance_bias.tolist() == pytest.approx([0.1, -0.1, 0.2, -0.2])


def test_the_pre_step_hook_solves_every_layer_and_update_routers_then_does_nothing():
    def stepped(hooked: bool) -> list[torch.Tensor]:
        model = small_lm("quantile_global", {"top_k": 2}, torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if hooked:
            assert register_quantile_balancing_hook(opt, model) is not None
        idx = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
        model(idx, idx).loss.backward()
        opt.step()
        solved = [r.balance_bias.clone() for r in model.routers()]
        if hooked:
            assert all(r.histogram_ER.sum() == 0 for r in model.routers())  # solved before the step
        moe.update_routers(model)
        if hooked:
            assert all(torch.equal(a, r.balance_bias) for a, r in zip(solved, model.routers()))
        return [r.balance_bias.clone() for r in model.routers()]

    hooked, plain = stepped(True), stepped(False)
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(hooked, plain))
    assert register_quantile_balancing_hook(torch.optim.SGD([nn.Parameter(torch.ones(1))]), nn.Linear(1, 1)) is None


@pytest.mark.parametrize(
    "options,message",
    [
        ({"gate": "softmax"}, "sigmoid"),
        ({"aux_loss_coef": 0.01}, "--moe-aux-loss-coeff 0"),
        ({"global_aux_loss_coef": 0.01}, "auxiliary loss"),
        ({"num_expert_groups": 2, "num_limited_groups": 1}, "num_expert_groups"),
        ({"balance_rate": 0.1}, "balance_rate"),
        ({"top_k": 4}, "below num_experts"),
        ({"num_bins": 0}, "num_bins"),
    ],
)
def test_combinations_the_peers_refuse_raise_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        moe.build_router("quantile_global", d_model=4, num_experts=4, **options)


def test_kv_cache_decoding_and_replay_equal_the_full_forward():
    model = small_lm("quantile_global", {"top_k": 2}, max_seq_len=40)
    with torch.no_grad():
        for r in model.routers():
            r.balance_bias.copy_(torch.tensor([0.2, -0.1, 0.0, -0.1]))
    model.eval()
    seq, logits = model.generate(torch.randint(0, 32, (2, 5)), 12, temperature=0, return_logits=True)
    torch.testing.assert_close(logits, model(seq[:, :-1]).logits, rtol=0, atol=1e-5)  # fp32 as test_decode
    model.train()
    idx = seq[:, :-1]
    with moe.record_routing(model) as record:
        out = model(idx, idx)
    recorded = [r.histogram_ER.clone() for r in model.routers()]
    with moe.replay_routing(model, record):
        again = model(idx, idx)
    assert torch.equal(out.logits, again.logits) and torch.equal(out.aux_loss, again.aux_loss)
    assert all(torch.equal(2 * h, r.histogram_ER) for h, r in zip(recorded, model.routers()))  # replay records too


class CurrentBatchQuantile(nn.Module):
    """A planted leak: the bias solved from the very forward it routes (the batch's own quantiles,
    future tokens included) while the router keeps claiming causality and batch invariance."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = moe.build_router("quantile_global", d_model=16, num_experts=4, top_k=1)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        was = self.router.training
        self.router.train()
        with torch.no_grad():
            self.router.balance_bias.zero_()
            self.router(x_BTD)
            self.router.update_after_step()
        self.router.train(was)
        out = self.router(x_BTD).dense()
        self.router.histogram_ER.zero_()
        return out


def test_audit_finds_the_router_causal_and_the_current_batch_variant_leaking():
    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    honest = MoETransformer(preset("tiny", d_model=32, n_layers=2, router="quantile_global"), init_seed=0)
    for r in honest.routers():
        r.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.0, -0.1]))
    report = audit(honest, torch.randint(0, 256, (2, 12)), trials=1, agreement=False)
    assert report.claims == moe.Claims(True, True, True, True), report.table()
    assert not report.leaks and not report.violations and not report.unshown, report.table()
    leaky = audit(CurrentBatchQuantile(), x, trials=1, agreement=False)
    assert leaky.leaks and leaky.violations, leaky.table()
    assert not leaky.batch_invariant, leaky.table()
