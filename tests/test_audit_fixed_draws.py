"""A mode judged by its noise is audited again with every random draw fixed at its median
(moe.audit.fixed_draws, engine._with_fixed_draws): a leak the noise hides from any test of a few
dozen draws shows in every comparison, and a target whose rule is causal gains no finding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe.audit import audit
from moe.audit.fixed_draws import FixedDraws, host_medians

X = torch.tensor([[0.3, -1.2], [2.0, 0.1]])


@pytest.mark.parametrize(
    ("draw", "median"),
    [
        (lambda: torch.rand(2, 3), torch.full((2, 3), 0.5)),
        (lambda: torch.randn(4), torch.zeros(4)),
        (lambda: torch.rand_like(X), torch.full((2, 2), 0.5)),
        (lambda: torch.randint(10, (3,)), torch.tensor([4, 4, 4])),  # [0, 10): 4
        (lambda: torch.randint(3, 9, (2,)), torch.tensor([5, 5])),  # [3, 9): 5
        (lambda: torch.randperm(5), torch.arange(5)),
        (lambda: torch.multinomial(torch.tensor([[0.1, 0.6, 0.3]]), 2), torch.tensor([[1, 2]])),
        (lambda: torch.bernoulli(torch.tensor([0.7, 0.2, 0.5])), torch.tensor([1.0, 0.0, 1.0])),
        (lambda: torch.empty(3).uniform_(-1, 3), torch.full((3,), 1.0)),
        (lambda: torch.empty(2).normal_(2.0, 5.0), torch.full((2,), 2.0)),
        (lambda: torch.empty(2).exponential_(2.0), torch.full((2,), math.log(2) / 2)),
        (lambda: torch.empty(3, dtype=torch.long).random_(2, 10), torch.tensor([5, 5, 5])),  # [2, 10): 5
        (lambda: torch.normal(torch.tensor([1.0, -2.0]), 3.0), torch.tensor([1.0, -2.0])),
        (lambda: F.dropout(X, 0.1, True), X / 0.9),  # a keep probability of 0.9: every element kept
        (lambda: F.dropout(X, 0.6, True), torch.zeros(2, 2)),  # of 0.4: every element dropped
        (  # Gumbel noise: -log(-log(U)) of a uniform at its median
            lambda: torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((2,)),
            torch.full((2,), -math.log(math.log(2))),
        ),
        (lambda: F.gumbel_softmax(torch.tensor([[1.0, 2.0, 0.5]]), hard=True), torch.tensor([[0.0, 1.0, 0.0]])),
        (lambda: torch.empty(2).cauchy_(1.5, 4.0), torch.full((2,), 1.5)),  # the location, not the scale
        (lambda: torch.empty(2).log_normal_(0.5, 2.0), torch.full((2,), math.exp(0.5))),  # e^mean
        (lambda: torch.empty(3, dtype=torch.long).random_(6), torch.tensor([2, 2, 2])),  # [0, 6): 2
        (lambda: torch.randint_like(X, 3, 9), torch.full((2, 2), 5.0)),  # [3, 9): 5
        (lambda: F.dropout(X, 0.5, True), X / 0.5),  # a keep probability of 1/2 is kept
        # native_dropout (F.dropout's op on an accelerator and under autograd tracing; a CPU
        # F.dropout above draws a bernoulli_ mask): every element kept at p <= 1/2, none above
        (lambda: torch.native_dropout(X, 0.1, True)[0], X / 0.9),
        (lambda: torch.native_dropout(X, 0.5, True)[0], X / 0.5),
        (lambda: torch.native_dropout(X, 0.5, True)[1], torch.ones(2, 2)),  # the mask: all kept
        (lambda: torch.native_dropout(X, 0.6, True)[0], torch.zeros(2, 2)),
        (lambda: torch.native_dropout(X, 0.6, False)[0], X),  # not training: no dropout at all
        (  # with replacement: the docstring's likeliest first, each category once ...
            lambda: torch.multinomial(torch.tensor([[0.1, 0.6, 0.3]]), 3, replacement=True),
            torch.tensor([[1, 2, 0]]),
        ),
        (  # ... and the likeliest repeated when more are drawn than there are categories
            lambda: torch.multinomial(torch.tensor([[0.1, 0.6, 0.3]]), 4, replacement=True),
            torch.tensor([[1, 1, 1, 1]]),
        ),
    ],
)
def test_each_draw_is_fixed_at_the_median_of_its_law(draw, median):
    with FixedDraws() as fixed:
        got = draw()
    assert not fixed.unknown
    torch.testing.assert_close(got, median.to(got.dtype), rtol=1e-6, atol=1e-7)


def discrete_median(pmf, support):
    """The smallest k of ``support`` whose CDF reaches 1/2, summed in float64 from the law's pmf."""
    total = 0.0
    for k in support:
        total += pmf(k)
        if total >= 0.5:
            return float(k)
    raise AssertionError("the support given holds less than half the mass")


@pytest.mark.parametrize(
    ("draw", "pmf", "support"),
    [
        (  # geometric on {1, 2, ...}, p = 0.3: P(1) = 0.3, P(<= 2) = 0.51
            lambda: torch.empty(2).geometric_(0.3),
            lambda k: 0.7 ** (k - 1) * 0.3,
            range(1, 100),
        ),
        (  # Poisson(2.8): P(<= 2) = 0.47, P(<= 3) = 0.69
            lambda: torch.poisson(torch.full((2,), 2.8)),
            lambda k: math.exp(-2.8) * 2.8**k / math.factorial(k),
            range(100),
        ),
        (  # Binomial(7, 0.3): P(<= 1) = 0.33, P(<= 2) = 0.65
            lambda: torch.binomial(torch.full((2,), 7.0), torch.full((2,), 0.3)),
            lambda k: math.comb(7, k) * 0.3**k * 0.7 ** (7 - k),
            range(8),
        ),
    ],
)
def test_each_discrete_draw_is_fixed_at_the_median_of_its_pmf(draw, pmf, support):
    with FixedDraws() as fixed:
        got = draw()
    assert not fixed.unknown
    assert got.tolist() == [discrete_median(pmf, support)] * 2


def test_an_op_it_does_not_know_keeps_drawing_and_is_named():
    with FixedDraws() as fixed:
        first = torch._standard_gamma(torch.full((64,), 2.0))
        second = torch._standard_gamma(torch.full((64,), 2.0))
    assert fixed.unknown == {"_standard_gamma"} and not torch.equal(first, second)


class DropsOverTheBatch(nn.Module):
    """pjlab-sys4nlp/llama-moe's SwitchBalancedGate + SwitchDropTokenCalculator, written here:
    a Gumbel-sampled top-1 gate (in both modes), a capacity of 1.25 N / E over the flattened
    batch, an overfull expert keeping a random subset of its tokens (``torch.randperm``). The
    future moves an earlier token's chance of being dropped by a few points: a leak in law that
    64 draws cannot see, and in every comparison once the draws are fixed."""

    def __init__(self, d: int = 16, experts: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = nn.Parameter(torch.randn(d, experts, generator=g) / d**0.5)
        self.expert = nn.Parameter(torch.randn(experts, d, d, generator=g) / d**0.5)

    def forward(self, x_BTD):
        x = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits = x @ self.gate
        gumbel = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(logits.shape)
        score, choice = (logits + gumbel).max(-1)
        capacity = int(1.25 * x.shape[0] / self.expert.shape[0])
        y = torch.zeros_like(x)
        for e in range(self.expert.shape[0]):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() > capacity:
                rows = rows[torch.randperm(rows.numel())][:capacity]
            y[rows] = torch.tanh(x[rows] @ self.expert[e])
        return (y * score[:, None]).view(x_BTD.shape)


def test_a_random_drop_over_the_batch_behind_a_sampled_gate_leaks_with_its_draws_fixed():
    report = audit(DropsOverTheBatch(), torch.randn(2, 16, 16), agreement=False)
    assert report.regime == "distribution"
    assert report.leaks and report.leaks_in == ["train", "eval"]
    fixed = [p for p in report.probes if p.leaks and p.kind == "future"]
    assert fixed and all(p.name.endswith(", draws fixed") for p in fixed)  # the noisy tests saw nothing
    assert "with the target's random draws fixed at their medians" in report.summary()


class CausalNoise(nn.Module):
    """Causal, with noise everywhere: a noisy top-2 gate per token, a sampled extra expert per
    token (multinomial), dropout on the output."""

    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.gate = nn.Parameter(torch.randn(d, experts, generator=g) / d**0.5)
        self.expert = nn.Parameter(torch.randn(experts, d, d, generator=g) / d**0.5)

    def forward(self, x_BTD):
        logits = x_BTD @ self.gate
        noisy = logits + 0.5 * torch.randn_like(logits)
        weight, top = noisy.softmax(-1).topk(2, dim=-1)
        extra = torch.multinomial(logits.softmax(-1).reshape(-1, logits.shape[-1]), 1).view(*top.shape[:-1], 1)
        chosen = torch.cat([top, extra], -1)
        out = torch.einsum("btd,edf->btef", x_BTD, self.expert)
        picked = out.gather(2, chosen[..., None].expand(-1, -1, -1, out.shape[-1]))
        mixed = (picked[..., :2, :] * weight[..., None]).sum(2) + picked[..., 2, :]
        return F.dropout(mixed, 0.1, self.training)


def test_a_causal_target_with_noise_gains_no_finding_with_its_draws_fixed():
    report = audit(CausalNoise(), torch.randn(2, 12, 16), agreement=False)
    assert report.regime != "deterministic"
    assert not report.leaks and report.batch_invariant and report.decode_consistent
    assert not [p.name for p in report.probes if "draws fixed" in p.name]
    # the pass ran and says what it compared: a clean verdict names it too
    passes = [n for n in report.notes if "audited again with its random draws fixed at their medians" in n]
    assert passes and all("found nothing the noisy audit had not" in n for n in passes), report.notes


class GammaNoise(nn.Module):
    """Noise from an op the median table does not know (a Gamma sample), over the whole batch."""

    def forward(self, x_BTD):
        return x_BTD * torch._standard_gamma(torch.full_like(x_BTD, 2.0))


def test_noise_that_cannot_be_fixed_leaves_the_noisy_verdict_and_says_why():
    report = audit(GammaNoise(), torch.randn(2, 8, 4), modes=("eval",), agreement=False)
    assert not report.leaks and not [p for p in report.probes if "draws fixed" in p.name]
    assert any(
        "not audited with its random draws fixed at their medians" in n and "_standard_gamma" in n for n in report.notes
    ), report.notes


class GaussianStep(nn.Module):
    """tests/test_audit_power.py's NoisyStep with Gaussian noise: unit noise drawn in a shape that
    follows the data, and 0.1 x the sign of the second half's sum added to the first half. The
    noisy test calls it INCONCLUSIVE at best; with its noise at the median (0) every comparison
    shows the step."""

    def forward(self, x_BTD):
        b, t, d = x_BTD.shape
        extra = int((x_BTD[..., 0] > 0).sum())
        y = x_BTD + torch.randn(extra + b * t, d)[extra:].reshape(b, t, d)
        y[:, : t // 2] = y[:, : t // 2] + 0.1 * torch.sign(x_BTD[:, t // 2 :].sum())
        return y


def test_a_weak_step_under_gaussian_noise_leaks_with_its_noise_at_its_median():
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))
    report = audit(GaussianStep(), x, modes=("eval",), agreement=False)
    assert report.leaks_in == ["eval"] and report.verdict != "INCONCLUSIVE", report.table()
    assert {p.name for p in report.probes if p.leaks} <= {
        f"{n}, draws fixed" for n in ("random_future", "adversarial_future", "decode_consistency", "batch_interference")
    }


def test_python_and_numpy_draws_are_fixed_while_host_medians_is_entered():
    numpy = pytest.importorskip("numpy")
    import random

    order = [3, 1, 2]
    with host_medians():
        numpy.random.shuffle(order)
        random.shuffle(order)
        got = (
            order,
            numpy.random.rand(2).tolist(),
            float(numpy.random.randn()),
            numpy.random.randint(10, size=3).tolist(),  # [0, 10): 4
            numpy.random.permutation(4).tolist(),
            numpy.random.choice([7, 8, 9], p=[0.2, 0.5, 0.3]),  # the likeliest
            numpy.random.choice(5, 2, replace=False).tolist(),  # the first
            random.random(),
            random.randint(1, 6),  # [1, 6]: 3
            random.choice("abc"),
        )
    assert got == ([3, 1, 2], [0.5, 0.5], 0.0, [4, 4, 4], [0, 1, 2, 3], 8, [0, 1], 0.5, 3, "a")
    numpy.random.seed(0)  # restored: real draws again
    assert numpy.random.rand() == pytest.approx(0.5488135039273248)


def test_the_other_host_draws_are_fixed_at_their_medians_by_hand():
    """The rest of host_medians' table, each against the median of its law worked out by hand."""
    numpy = pytest.importorskip("numpy")
    import random

    with host_medians():
        got = (
            numpy.random.uniform(2.0, 4.0),  # the middle of [2, 4)
            numpy.random.normal(5.0, 2.0),  # the mean, not the spread
            numpy.random.randint(3, 9),  # [3, 9): 5
            numpy.random.random_sample(2).tolist(),
            numpy.random.choice(3, 5).tolist(),  # with replacement: the first, then round again
            random.randint(1, 5),  # [1, 5] inclusive: 3
            random.randrange(10),  # 0..9: the lower middle, 4
            random.randrange(0, 10, 3),  # 0, 3, 6, 9: 3
            random.uniform(2.0, 4.0),
            random.gauss(5.0, 2.0),
            random.sample(range(5), 2),
        )
    assert got == (3.0, 5.0, 5, [0.5, 0.5], [0, 1, 2, 0, 1], 3, 4, 3, 3.0, 5.0, [0, 1])


class ShuffledGreedy(nn.Module):
    """StableMoE's greedy balanced assignment, written here: the experts in an ``np.random.shuffle``
    order, each taking its top N / E unassigned tokens of the flattened batch. A prefix changes
    which tokens earlier experts take; the noisy decode test misses it, the order fixed shows it."""

    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = nn.Parameter(torch.randn(d, experts, generator=g) / d**0.5)
        self.expert = nn.Parameter(torch.randn(experts, d, d, generator=g) / d**0.5)

    def forward(self, x_BTD):
        numpy = pytest.importorskip("numpy")
        x = x_BTD.reshape(-1, x_BTD.shape[-1])
        scores = x @ self.gate
        order = list(range(self.gate.shape[1]))
        numpy.random.shuffle(order)
        chosen = torch.full((x.shape[0],), -1)
        capacity = -(-x.shape[0] // len(order))
        for e in order:
            free = chosen < 0
            top = scores[:, e].masked_fill(~free, float("-inf")).topk(min(capacity, int(free.sum()))).indices
            chosen[top] = e
        return torch.tanh(torch.einsum("nd,ndf->nf", x, self.expert[chosen])).view(x_BTD.shape)


def test_a_numpy_shuffled_greedy_assignment_differs_at_decode_with_its_order_fixed():
    report = audit(
        ShuffledGreedy(), torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)), agreement=False
    )
    assert report.leaks and report.decode_consistent is False, report.table()
    assert "decode_consistency, draws fixed" in [p.name for p in report.probes if p.leaks], report.table()


@pytest.mark.parametrize("q", [0.25, 0.75])
@pytest.mark.parametrize(
    ("draw", "law"),
    [
        (lambda: torch.rand(3), torch.distributions.Uniform(0.0, 1.0)),
        (lambda: torch.empty(3).uniform_(-1, 3), torch.distributions.Uniform(-1.0, 3.0)),
        (lambda: torch.randn(3), torch.distributions.Normal(0.0, 1.0)),
        (lambda: torch.empty(3).normal_(2.0, 5.0), torch.distributions.Normal(2.0, 5.0)),
        (lambda: torch.empty(3).exponential_(2.0), torch.distributions.Exponential(2.0)),
        (lambda: torch.empty(3).cauchy_(1.0, 0.5), torch.distributions.Cauchy(1.0, 0.5)),
    ],
)
def test_each_continuous_draw_is_fixed_at_the_quantile_its_law_gives(draw, law, q):
    with FixedDraws(quantile=q) as fixed:
        got = draw()
    assert not fixed.unknown
    torch.testing.assert_close(got, law.icdf(torch.tensor(q)).expand(3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q", [0.25, 0.5, 0.75])
def test_integers_and_bernoullis_are_fixed_at_the_quantile_counted_by_hand(q):
    """The q-quantile of a uniform integer in [low, high): the smallest k with (k - low + 1) /
    (high - low) >= q, counted over the range; of a Bernoulli(p): 1 where P(0) = 1 - p < q."""
    with FixedDraws(quantile=q) as fixed:
        ints = torch.randint(3, 9, (2,))
        probs = torch.tensor([0.2, 0.3, 0.6, 0.8])
        bits = torch.bernoulli(probs)
    assert not fixed.unknown
    k = next(k for k in range(3, 9) if (k - 3 + 1) / 6 >= q)
    assert ints.tolist() == [k, k]
    assert bits.tolist() == [float(p >= 1 - q) for p in probs.tolist()]


class RandomSecondExpert(DropsOverTheBatch):
    """fairseq's NLLB ``Top2Gate`` with ``second_expert_policy="random"`` and batch-prioritised
    routing, written here: top-2 of a softmax gate per token, the second expert kept where
    2 p2 > U (U uniform), each expert holding 2 ceil(N / E) slots over the flattened batch, first
    choices served before second ones, each in order of the token's top probability. A prefix has
    fewer slots; at the median of U about half the second experts are kept and no expert
    overflows, so the prefix routes as the full sequence; at the lower quartile most are kept and
    an expert overflows at one length and not at another. The noisy decode test does not see the
    few tokens whose law changes (by hand, 2,000 draws each: total variation 0.37 for token (1, 6)
    and 0.20 for (0, 1) between the prefix 0..9 and the full sequence, against 0.02-0.03 between
    draws of one law). Its gate and experts are DropsOverTheBatch's, with 4 experts."""

    def __init__(self) -> None:
        super().__init__(experts=4)

    def forward(self, x_BTD):
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        n, e = x_ND.shape[0], self.gate.shape[1]
        probs_NE = (x_ND @ self.gate).softmax(-1)
        top_N2, choice_N2 = probs_NE.topk(2, dim=-1)
        kept_N2 = torch.stack([torch.ones(n, dtype=torch.bool), 2 * top_N2[:, 1] > torch.rand(n)], -1)
        order = top_N2[:, 0].argsort(descending=True, stable=True)  # priority by the top probability
        capacity, used, weight_NE = 2 * math.ceil(n / e), [0] * e, torch.zeros(n, e)
        for k in range(2):  # every first choice before any second one
            for i in order.tolist():
                c = int(choice_N2[i, k])
                if kept_N2[i, k] and used[c] < capacity:
                    used[c] += 1
                    weight_NE[i, c] = top_N2[i, k]
        y_ND = torch.einsum("ne,nd,edf->nf", weight_NE, x_ND, self.expert)
        return y_ND.view(x_BTD.shape)


def test_a_random_second_expert_under_a_shared_capacity_differs_at_decode_with_its_draws_at_a_quartile():
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    report = audit(RandomSecondExpert(), x, modes=("eval",), agreement=False)
    assert report.decode_consistent is False, report.summary()
    (found,) = [p for p in report.probes if p.leaks and p.kind == "decode"]
    assert found.name == "decode_consistency, draws fixed" and "quartiles" in found.found_by, found.found_by


class RandomPairs(nn.Module):
    """zoology's BigBIRDAttention's random part, written here: 3 pairs of positions (i, j), each
    drawn over [0, T - 1) per call, kept where i > j (causal), position i adding position j's
    input. A prefix draws its pairs over fewer positions, so the law of an output at t < T
    differs between the prefix and the full sequence. At any one quantile the two draws are tied
    and no pair is kept; a call's draws at the upper then the lower quartile keep one."""

    def forward(self, x_BTD):
        t = x_BTD.shape[1]
        i, j = torch.randint(t - 1, (3,)), torch.randint(t - 1, (3,))
        keep = i > j
        adds_TT = torch.zeros(t, t).index_put((i[keep], j[keep]), torch.tensor(1.0), accumulate=True)
        return x_BTD + torch.einsum("ts,bsd->btd", adds_TT, x_BTD)


def test_random_pairs_over_the_length_differ_at_decode_with_a_calls_draws_at_its_quartiles_in_turn():
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    report = audit(RandomPairs(), x, modes=("eval",), agreement=False)
    assert not report.leaks and report.batch_invariant, report.summary()
    assert report.decode_consistent is False, report.summary()
    (found,) = [p for p in report.probes if p.leaks]
    assert found.name == "decode_consistency, draws fixed" and "in turn" in found.found_by, found.found_by


def test_a_calls_draws_are_fixed_in_turn_and_a_call_that_draws_other_ops_is_told():
    fixed = FixedDraws((0.75, 0.25))
    with fixed:
        first, second = torch.randint(9, (2,)), torch.randint(9, (2,))
    assert first.tolist() == [6, 6] and second.tolist() == [2, 2]  # the quartiles of [0, 9): 6 and 2
    assert not fixed.misaligned
    with fixed:
        torch.rand(2)
    assert fixed.misaligned


class NoisePerExpertBatch(nn.Module):
    """Causal: a top-1 gate per token and Gaussian noise drawn for each expert that holds tokens,
    so how many draws a call makes, and which expert makes the k-th, follow the data. With a
    call's draws at its quartiles in turn a prefix that leaves an expert empty shifts every later
    expert's noise: those passes must not count."""

    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.gate = nn.Parameter(torch.randn(d, experts, generator=g))

    def forward(self, x_BTD):
        choice = (x_BTD @ self.gate).argmax(-1)
        y = x_BTD.clone()
        for e in range(self.gate.shape[1]):
            rows = choice == e
            if rows.any():
                y[rows] = x_BTD[rows] * (e + 1) + torch.randn(int(rows.sum()), x_BTD.shape[-1])
        return y


def test_draws_in_turn_do_not_count_where_the_calls_draw_other_ops():
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))
    report = audit(NoisePerExpertBatch(), x, modes=("eval",), agreement=False)
    assert not report.leaks and report.batch_invariant and report.decode_consistent, report.summary()
    assert any("in turn" in n and "draw other random ops" in n for n in report.notes), report.notes
