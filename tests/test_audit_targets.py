"""The audit on targets written the way other libraries write MoE code: they `.view()` their
input, scale it in place, reject some lengths, draw random numbers, return NaN or structured
outputs. Each is judged right in every one of 5 seeds.

Shapes: B=4, T=16, D=8, E=4 experts (T divisible by E).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

import pytest
import torch
import torch.nn.functional as F
from extras import need
from torch import Tensor, nn

from moe.audit import audit
from moe.audit.comparator import DRAWS, distribution_change, resolution_of
from moe.audit.report import DECODE_PROBE
from moe.routers import build_router
from moe.routing import Claims

B, T, D, E = 4, 16, 8, 4
SEEDS = range(5)


def example(seed: int, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


class Experts(nn.Module):
    """E linear experts and a linear gate: the parts every block below shares."""

    def __init__(self, seed: int, d: int = D, e: int = E) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(d, e, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(e, d, d) / d**0.5)

    def expert(self, e: int, x_ND: Tensor) -> Tensor:
        return torch.tanh(x_ND @ self.w_EDD[e])


class ViewingTopK(Experts):
    """Dropless top-2 that flattens its input with .view() (fails on non-contiguous input)."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.view(-1, d)
        probs_NE = self.gate(x_ND).softmax(-1)
        w_NK, idx_NK = probs_NE.topk(2, dim=-1)
        y_ND = torch.zeros_like(x_ND)
        for e in range(self.w_EDD.shape[0]):
            n, k = (idx_NK == e).nonzero(as_tuple=True)
            y_ND.index_add_(0, n, w_NK[n, k, None] * self.expert(e, x_ND[n]))
        return y_ND.view(b, t, d)


class JitteredTopK(ViewingTopK):
    """Switch-Transformers style router jitter: scales its input in place in training mode."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        if self.training:
            x_BTD *= torch.empty_like(x_BTD).uniform_(0.9, 1.1)
        return super().forward(x_BTD)


class DivisibleGate(Experts):
    """Asserts T % E == 0, like gates that split the sequence into E equal groups. Leaky:
    expert choice, each expert takes its T / E best tokens of the sequence. Clean: top-1."""

    def __init__(self, seed: int, leaky: bool) -> None:
        super().__init__(seed)
        self.leaky = leaky

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        e = self.w_EDD.shape[0]
        assert t % e == 0, f"sequence length {t} is not divisible by {e} experts"
        scores_BTE = self.gate(x_BTD).softmax(-1)
        if self.leaky:
            top_BCE = scores_BTE.topk(t // e, dim=1).indices
            w_BTE = torch.zeros_like(scores_BTE).scatter(1, top_BCE, scores_BTE.gather(1, top_BCE))
        else:
            w_BTE = torch.zeros_like(scores_BTE).scatter(2, scores_BTE.argmax(-1, keepdim=True), 1.0)
        y_EBTD = torch.stack([self.expert(i, x_BTD) for i in range(e)])
        return torch.einsum("bte,ebtd->btd", w_BTE, y_EBTD)


class StochasticSecondExpert(Experts):
    """First expert: the gate's argmax. Second: drawn at random, with probability from the gate
    scores (one uniform per position). Capacity 6 per expert and sequence (of 8 on average).
    GShard-style (leaky): every first choice of the sequence is queued before any second
    choice, so later tokens' first choices can take an earlier token's second slot. Clean:
    the queue is in token order, each token's first choice before its second."""

    CAPACITY = 6

    def __init__(self, seed: int, gshard: bool) -> None:
        super().__init__(seed)
        self.gshard = gshard

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        probs_BTE = self.gate(x_BTD).softmax(-1)
        first_BT = probs_BTE.argmax(-1)
        rest_BTE = probs_BTE.scatter(-1, first_BT[..., None], 0.0)
        cdf_BTE = (rest_BTE / rest_BTE.sum(-1, keepdim=True)).cumsum(-1)
        u_BT1 = torch.rand(b, t, 1, device=x_BTD.device)
        second_BT = (cdf_BTE < u_BT1).sum(-1).clamp_max(probs_BTE.shape[-1] - 1)
        choice_BTK = torch.stack([first_BT, second_BT], -1)
        # Queue order of the 2T choices of each sequence: choice-major (GShard) or token-major.
        order_BQ = choice_BTK.transpose(1, 2).reshape(b, 2 * t) if self.gshard else choice_BTK.reshape(b, 2 * t)
        onehot_BQE = F.one_hot(order_BQ, probs_BTE.shape[-1])
        kept_BQ = ((onehot_BQE.cumsum(1) * onehot_BQE).sum(-1) <= self.CAPACITY).float()
        kept_BTK = kept_BQ.reshape(b, 2, t).transpose(1, 2) if self.gshard else kept_BQ.reshape(b, t, 2)
        w_BTK = probs_BTE.gather(-1, choice_BTK) * kept_BTK
        y_EBTD = torch.stack([self.expert(i, x_BTD) for i in range(probs_BTE.shape[-1])])
        y_BTKD = y_EBTD.permute(1, 2, 0, 3).gather(2, choice_BTK[..., None].expand(-1, -1, -1, d))
        return (w_BTK[..., None] * y_BTKD).sum(2)


class DropoutExpertChoice(nn.Module):
    """Dropout in front of an expert-choice router, claiming (falsely) to be causal."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.drop = nn.Dropout(0.1)
        self.router = build_router("expert_choice", d_model=D, num_experts=E, capacity_factor=1.0)

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.router(self.drop(x_BTD)).dense()


class PerExpertDropout(ViewingTopK):
    """Causal dropless top-2 with dropout inside each expert's batch of tokens (as Switch
    Transformers' experts have): the noise is drawn in shapes that depend on the routing."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drop = nn.Dropout(0.1)

    def expert(self, e: int, x_ND: Tensor) -> Tensor:
        return self.drop(super().expert(e, x_ND))


class NaNAndMeanLeak(nn.Module):
    """A NaN at one output entry and a 1e-4 sequence-mean leak everywhere."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(D, D)

    def forward(self, x_BTD: Tensor) -> Tensor:
        y = self.lin(x_BTD) + 1e-4 * x_BTD.mean(dim=1, keepdim=True)
        if x_BTD.shape[1] > 3:
            y[0, 3, 0] = float("nan")
        return y


def _assert_clean(report, modes=("train", "eval")) -> None:
    assert report.error is None and not report.leaks, report.table()
    assert [m for m in modes if report.probe("random_future", m).ran] == list(modes), report.table()


@pytest.mark.parametrize("cls", [ViewingTopK, JitteredTopK])
def test_view_and_in_place_jitter_are_audited(cls):
    """The jitter is drawn in training: that mode is random, "seeded" (the same draws for one
    seed and input shape), not "deterministic"."""
    regimes = {"train": "seeded" if cls is JitteredTopK else "deterministic", "eval": "deterministic"}
    for seed in SEEDS:
        report = audit(cls(seed), example(seed), seed=seed)
        _assert_clean(report)
        assert report.regimes == regimes and report.batch_invariant and report.decode_consistent, report.table()
        assert all(p.failed == 0 for p in report.probes), report.table()
        assert report.probe("jacobian", "train") is not None, "the in-place scaling must not stop the Jacobian"


@pytest.mark.parametrize("leaky", [False, True])
def test_target_that_rejects_lengths(leaky):
    accepted = [n for n in range(1, T) if n % E == 0]
    for seed in SEEDS:
        report = audit(DivisibleGate(seed, leaky), example(seed), seed=seed)
        assert report.error is None, report.table()
        assert report.leaks_in == (["train", "eval"] if leaky else []), report.table()
        for mode in ("train", "eval"):
            decode = report.probe(DECODE_PROBE, mode)
            assert decode.ran and decode.comparisons == len(accepted), report.table()
            assert decode.skipped_lengths == [n for n in range(1, T) if n not in accepted], report.table()
            assert "not divisible" in decode.errors[0], report.table()


@pytest.mark.parametrize("gshard", [pytest.param(False, marks=pytest.mark.slow), True])
def test_stochastic_second_expert(gshard):
    """Its noise is one uniform per position: same seed and shape, same noise, so it is audited by
    a fixed seed (the seeded regime) and the GShard queue's leak shows in both modes."""
    for seed in SEEDS:
        report = audit(StochasticSecondExpert(seed, gshard), example(seed), seed=seed)
        assert report.error is None and report.regime == "seeded", report.table()
        assert report.leaks_in == (["train", "eval"] if gshard else []), f"seed {seed}\n{report.table()}"


def test_dropout_before_expert_choice_is_a_false_causal_claim_in_both_modes():
    for seed in SEEDS:
        report = audit(DropoutExpertChoice(seed), example(seed), seed=seed)
        assert report.violations[:2] == [
            "claims causal in train mode but leaks",
            "claims causal in eval mode but leaks",
        ], report.table()


def test_dropout_inside_expert_batches_is_audited_by_distribution_and_clean():
    for seed in SEEDS:
        report = audit(PerExpertDropout(seed), example(seed), seed=seed)
        _assert_clean(report)
        assert report.regimes == {"train": "distribution", "eval": "deterministic"}, report.table()
        assert report.probe("random_future", "train").p_value is not None


@pytest.mark.parametrize("paired", [False, True])
def test_permutation_test_false_positive_rate_on_a_clean_stochastic_target(paired):
    """Null comparisons: the clean per-expert-dropout block on an input and on the same input
    with its future resampled, 8 seeds each (fresh seeds per trial, so the 200 trials are
    independent; ``paired``: draw i of both under the same seed, whose dropout masks then fall
    on rows that follow the routing, tested by swaps within pairs); at alpha = 0.05 the exact test rejects at most 5% of them in expectation (here:
    within 3 binomial standard deviations of 200 trials). The same test rejects a real 5%
    change of every output. The resolution is the audit's own for float32 outputs."""
    target = PerExpertDropout(0).train()
    gen = torch.Generator().manual_seed(0)
    cut = 7
    K = DRAWS[0]
    resolution = resolution_of(torch.float32)

    def draws(x: Tensor, seeds: range) -> Tensor:
        out = []
        for s in seeds:
            torch.manual_seed(s)
            with torch.no_grad():
                out.append(target(x.clone())[:, : cut + 1].double())
        return torch.stack(out)

    trials, alpha = 200, 0.05
    rejected = 0
    for i in range(trials):
        x = torch.randn(2, T, D, generator=gen)
        y = x.clone()
        y[:, cut + 1 :] = torch.randn(2, T - cut - 1, D, generator=gen)
        other = range(2 * K * i, 2 * K * i + K) if paired else range(2 * K * i + K, 2 * K * (i + 1))
        ref, var = draws(x, range(2 * K * i, 2 * K * i + K)), draws(y, other)
        p = distribution_change(ref, var, resolution, alpha=alpha, permutations=499, gen=gen, paired=paired).p
        rejected += p <= alpha
        if i < 20:
            shifted = distribution_change(
                ref, var * 1.05, resolution, alpha=alpha, permutations=499, gen=gen, paired=paired
            )
            assert shifted.p <= alpha and bool(shifted.changed_S.any()), shifted.p
    bound = trials * alpha + 3 * (trials * alpha * (1 - alpha)) ** 0.5
    assert rejected <= bound, f"{rejected} of {trials} null comparisons rejected at alpha={alpha}"


def test_nan_at_one_position_does_not_hide_a_small_leak():
    for seed in SEEDS:
        report = audit(NaNAndMeanLeak(seed), example(seed), seed=seed)
        assert report.leaks_in == ["train", "eval"], report.table()
        assert report.nonfinite == {"train": 1, "eval": 1}
        for p in report.probes:
            assert p.tolerance < 1e-3, report.table()
        # The NaN entry is compared as a value: unchanged NaN is no change.
        assert report.probe(DECODE_PROBE, "eval").routing_flips == 0, report.table()


class AllNaN(nn.Module):
    def forward(self, x_BTD: Tensor) -> Tensor:
        return torch.full_like(x_BTD, float("nan"))


class InfWhenFutureIsLarge(nn.Module):
    """Causal (y = x) except that position 0 turns +inf when the sum of positions > 0 exceeds
    the example's: the only trace of the leak is a finite value turning infinite."""

    def __init__(self, example_BTD: Tensor) -> None:
        super().__init__()
        self.threshold = float(example_BTD[:, 1:].sum())

    def forward(self, x_BTD: Tensor) -> Tensor:
        y = x_BTD.clone()
        if x_BTD.shape[1] > 1:
            y[:, 0] = torch.where(x_BTD[:, 1:].sum() > self.threshold, float("inf"), y[:, 0])
        return y


class CausalWithNaN(NaNAndMeanLeak):
    """A position-wise linear map (no leak) with a NaN at output position 5 of every sample."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        y = self.lin(x_BTD)
        if x_BTD.shape[1] > 5:
            y[:, 5] = float("nan")
        return y


def test_output_with_nothing_finite_is_not_audited():
    report = audit(AllNaN(), example(0))
    assert report.error is not None and "nothing to compare" in report.error, report.table()
    assert f"{B * T * D} entries" in report.error and report.nonfinite == {"train": B * T * D, "eval": B * T * D}
    assert report.verdict == "NOT AUDITED" and list(report.modes_not_audited) == ["train", "eval"]


def test_finite_turning_infinite_under_a_future_perturbation_is_a_leak():
    for seed in SEEDS:
        x = example(seed)
        report = audit(InfWhenFutureIsLarge(x), x, seed=seed)
        assert report.error is None and report.leaks_in == ["train", "eval"], report.table()
        p = report.probe("random_future", "eval")
        assert p.first_leaking_position == 0 and p.max_abs_delta == 0.0 and p.routing_flips > 0, report.table()


def test_nan_at_one_position_of_a_causal_target_leaves_it_clean():
    for seed in SEEDS:
        report = audit(CausalWithNaN(seed), example(seed), seed=seed)
        _assert_clean(report)
        assert report.nonfinite == {"train": B * D, "eval": B * D} and report.batch_invariant, report.table()


# -- structured outputs, keyword inputs --------------------------------------------------------
@dataclass
class PlainOutput:
    aux_loss: Tensor
    hidden: Tensor
    logits: Tensor


class ModelOutputLike(OrderedDict):
    """Like transformers' ModelOutput: a dataclass that is also an ordered dict of its set fields."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


@dataclass
class HFOutput(ModelOutputLike):
    last_hidden_state: Tensor | None = None
    logits: Tensor | None = None
    router_logits: Tensor | None = None


class Structured(nn.Module):
    """hidden: causal (positionwise); logits: leaks the sequence mean."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind, self.lin = kind, nn.Linear(D, D)

    def forward(self, x_BTD: Tensor):
        hidden = self.lin(x_BTD)
        logits = hidden + 0.1 * x_BTD.mean(dim=1, keepdim=True)
        aux = hidden.square().mean()
        if self.kind == "tuple":
            return logits, aux, hidden
        if self.kind == "dict":
            return {"aux_loss": aux, "hidden": hidden, "logits": logits}
        if self.kind == "dataclass":
            return PlainOutput(aux, hidden, logits)
        return HFOutput(last_hidden_state=hidden, logits=logits, router_logits=hidden.reshape(-1, D))


@pytest.mark.parametrize(
    "kind, clean_field",
    [("tuple", "2"), ("dict", "hidden"), ("dataclass", "hidden"), ("model_output", "last_hidden_state")],
)
def test_structured_outputs(kind, clean_field):
    """Default: `logits` (for the tuple: its first tensor), which leaks; `output=` picks the clean field."""
    for seed in SEEDS:
        target = Structured(kind, seed)
        assert audit(target, example(seed), seed=seed, modes=("eval",)).leaks_in == ["eval"]
        _assert_clean(audit(target, example(seed), seed=seed, modes=("eval",), output=clean_field), modes=("eval",))
    report = audit(Structured(kind, 0), example(0), modes=("eval",), output="missing")
    assert report.error is not None and "no field 'missing'" in report.error


class KeywordTokenModel(nn.Module):
    """A token model whose forward takes ids only as the keyword input_ids (HF style)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(50, D), nn.Linear(D, 50)

    def forward(self, *, input_ids: Tensor, attention_mask: Tensor | None = None) -> dict:
        return {"logits": self.head(self.embed(input_ids).cumsum(dim=1))}


def test_input_ids_keyword():
    idx = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(0))
    report = audit(KeywordTokenModel(), idx, modes=("eval",))
    _assert_clean(report, modes=("eval",))
    assert report.probe("jacobian", "eval") is not None


# -- failures, state --------------------------------------------------------------------------
def test_target_that_always_fails_is_reported_not_raised():
    def broken(x: Tensor) -> Tensor:
        raise RuntimeError("kaboom")

    report = audit(broken, example(0))
    assert report.error is not None and "kaboom" in report.error and "(4, 16, 8)" in report.error
    assert report.probes == []


def test_no_future_probe_ran_is_an_error():
    """A target that runs on the example only: nothing to compare, so no verdict."""
    x = example(0)

    def only_the_example(y: Tensor) -> Tensor:
        if not torch.equal(y, x):
            raise ValueError("unknown input")
        return y * 2

    report = audit(only_the_example, x, modes=("eval",))
    assert report.error is not None and report.error.startswith("no future-perturbation probe ran"), report.error
    assert "ValueError: unknown input" in report.error and not report.probe("random_future", "eval").ran


class Counting(nn.Module):
    """Changes its state in every forward: a non-persistent buffer, a parameter, a new buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()), persistent=False)
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x_BTD: Tensor) -> Tensor:
        self.calls += 1
        self.ema.mul_(0.9).add_(x_BTD.detach().mean(dim=(0, 1)))
        with torch.no_grad():
            self.lin.bias.add_(1.0)
        self.register_buffer("scratch", torch.ones(1))
        return self.lin(x_BTD) - self.lin.bias


def test_state_is_restored_exactly():
    target = Counting()
    target.eval()
    tensors = {k: v for k, v in [*target.named_parameters(), *target.named_buffers()]}
    values = {k: v.detach().clone() for k, v in tensors.items()}
    rng = torch.get_rng_state()
    audit(target, example(0))
    assert not target.training and torch.equal(torch.get_rng_state(), rng)
    after = dict([*target.named_parameters(), *target.named_buffers()])
    assert after.keys() == tensors.keys(), "a buffer added during the audit must be gone"
    for k, v in after.items():
        assert v is tensors[k] and torch.equal(v, values[k]), k


def test_bf16_target_gets_a_bf16_tolerance():
    for seed in SEEDS:
        target = ViewingTopK(seed).to(torch.bfloat16)
        report = audit(target, example(seed).to(torch.bfloat16), seed=seed, modes=("eval",))
        _assert_clean(report, modes=("eval",))
        leak = audit(
            DivisibleGate(seed, leaky=True).to(torch.bfloat16), example(seed).bfloat16(), seed=seed, modes=("eval",)
        )
        assert leak.leaks_in == ["eval"], leak.table()
    # 4 ulp of bf16 (eps 2**-7) at the output scale, not fp32's 100 ulp.
    scale = float(report.probe("random_future", "eval").tolerance) / (4 * 2**-7)
    assert 0.05 < scale < 10, report.table()


# -- a real transformers block ----------------------------------------------------------------
def test_transformers_mixtral_block_reaches_a_verdict():
    """Dropless top-2 that .view()s its input and jitters it in place in training mode: causal."""
    mixtral = need("transformers.models.mixtral.modeling_mixtral", "hf")
    from transformers import MixtralConfig

    torch.manual_seed(0)
    cfg = MixtralConfig(
        hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1
    )
    block = mixtral.MixtralSparseMoeBlock(cfg)
    with torch.no_grad():  # its experts are created with torch.empty: NaN-laden until initialised
        for p in block.parameters():
            p.normal_(0.0, 0.25)
    report = audit(block, example(0, 16), name="MixtralSparseMoeBlock")
    _assert_clean(report)
    assert report.batch_invariant and report.decode_consistent, report.table()
