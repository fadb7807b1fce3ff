"""The causality audit against positive controls (leaks it must flag in every seed), negative
controls (never flagged), and every built-in router's claims.

Control builders take a seed and return (target, example input). Shapes: B=4, T=16, D=8 (32 for routers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from moe.audit import AuditReport, AuditUsageError, audit, builtin_targets, summary_table
from moe.audit.probes import DECODE_PREFIXES
from moe.layer import MoELayer
from moe.model import MoETransformer, preset
from moe.routers import CapacityRouter, ExpertChoiceRouter, build_router
from moe.routing import Claims

FUTURE_PROBES = ("random_future", "adversarial_future", "jacobian")
"""The built-in probes of kind "future"."""
B, T, D = 4, 16, 8
LEAK_FROM, LEAK_TO = 11, 5
"""The single-position control: output position LEAK_TO reads input position LEAK_FROM."""


def example(seed: int, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


class PositionwiseMLP(nn.Module):
    """A dense MLP applied to each position on its own: causal and batch-invariant."""

    def __init__(self, d: int = D, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SequenceMeanLeak(PositionwiseMLP):
    """Adds coef * (mean over the whole sequence): a continuous future leak."""

    def __init__(self, coef: float, seed: int = 0, train_only: bool = False) -> None:
        super().__init__(seed=seed)
        self.coef, self.train_only = coef, train_only

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        if self.training or not self.train_only:
            y = y + self.coef * x.mean(dim=1, keepdim=True)
        return y


class SinglePositionLeak(PositionwiseMLP):
    """Output position LEAK_TO also reads input position LEAK_FROM; everything else is causal."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        if x.shape[1] <= LEAK_FROM:  # a prefix without the leaking position
            return y
        leak = torch.zeros_like(y)
        leak[:, LEAK_TO] = 0.5 * x[:, LEAK_FROM]
        return y + leak


class NextTokenLeak(PositionwiseMLP):
    """Each position also reads the next one (an attention mask off by one): the commonest leak."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        return torch.cat([y[:, :-1] + 0.5 * x[:, 1:], y[:, -1:]], dim=1)


class LastPositionDoubled(PositionwiseMLP):
    """Doubles the output of whatever position is last: causal in time and batch-invariant (no
    output reads another position's value), yet a prefix alone doubles its own last position,
    which the full sequence does not (a length-dependent rule, like pooling at the end)."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        return torch.cat([y[:, :-1], 2 * y[:, -1:]], dim=1)


class PrefixMean(nn.Module):
    """Cumulative mean over positions 0..t: a sequence statistic that is causal."""

    def forward(self, x: Tensor) -> Tensor:
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return x.cumsum(dim=1) / count


class BatchMixer(PositionwiseMLP):
    """Mixes the samples of the batch at the same position: clean in time, not batch-invariant."""

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + 0.5 * x.mean(dim=0, keepdim=True)


def router(name: str, seed: int, d: int = 32, **options) -> nn.Module:
    torch.manual_seed(seed)
    return build_router(name, d_model=d, num_experts=4, **options)


def token_model(router_name: str, seed: int) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny", router=router_name))
    idx = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    return model, idx


POSITIVE = {
    "expert_choice": lambda s: (router("expert_choice", s), example(s, 32)),
    "capacity_score": lambda s: (router("capacity", s, priority="score"), example(s, 32)),
    "gshard_top2_choice": lambda s: (router("capacity", s, top_k=2, priority="choice"), example(s, 32)),
    "sequence_mean_1e-4": lambda s: (SequenceMeanLeak(1e-4, seed=s), example(s)),
    "single_position": lambda s: (SinglePositionLeak(seed=s), example(s)),
    "token_model_expert_choice": lambda s: token_model("expert_choice", s),
}
"""Targets that leak in both modes (default router options: capacity factor 1.25 for capacity)."""

NEGATIVE = {
    "dense_mlp": lambda s: (PositionwiseMLP(seed=s), example(s)),
    "dropless_topk": lambda s: (router("topk", s, top_k=2), example(s, 32)),
    "capacity_position_sequence": lambda s: (
        router("capacity", s, priority="position", capacity_factor=1.0),
        example(s, 32),
    ),
    "prefix_mean": lambda s: (PrefixMean(), example(s)),
    "batch_mixer": lambda s: (BatchMixer(seed=s), example(s)),
}
"""Targets that never leak into the past."""


SEEDS = range(5)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The audit runs many forwards on tiny tensors: one thread is fastest on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _leaking_probes(report: AuditReport) -> list[str]:
    return [f"{p.name}/{p.mode}" for p in report.probes if p.leaks]


# -- controls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_positive_control_is_flagged_in_every_seed(name):
    for seed in SEEDS:
        target, x = POSITIVE[name](seed)
        report = audit(target, x, seed=seed)
        assert report.leaks_in == ["train", "eval"], f"{name} seed {seed}: {report.table()}"


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_control_is_never_flagged(name):
    for seed in SEEDS:
        target, x = NEGATIVE[name](seed)
        report = audit(target, x, seed=seed)
        future = [p for p in _leaking_probes(report) if p.split("/")[0] in FUTURE_PROBES]
        assert not report.leaks and not future, f"{name} seed {seed}: {report.table()}"
        assert report.batch_invariant == (name != "batch_mixer"), f"{name} seed {seed}: {report.table()}"


def test_continuous_leak_of_relative_size_1e4_is_caught_by_the_jacobian():
    """The Jacobian sees the 1e-4 / T dependence that the perturbation probes only just exceed."""
    for seed in SEEDS:
        report = audit(SequenceMeanLeak(1e-4, seed=seed), example(seed), seed=seed, modes=("eval",))
        jac = report.probe("jacobian", "eval")
        assert jac.leaks and jac.first_leaking_position == 0, report.table()
        # d y[s] / d x[r] = 1e-4 / T exactly, for every r > s.
        assert jac.max_abs_delta == pytest.approx(1e-4 / T, rel=1e-3), report.table()


def test_single_position_leak_is_located():
    """Random futures and the Jacobian probe every cut: exactly one of the T - 1 positions moves.
    The adversarial probe stops at its first finding, so only the position is checked there."""
    for seed in SEEDS:
        report = audit(SinglePositionLeak(seed=seed), example(seed), seed=seed, modes=("eval",))
        for name in FUTURE_PROBES:
            p = report.probe(name, "eval")
            assert p.leaks and p.first_leaking_position == LEAK_TO and p.leaking_positions == [LEAK_TO], report.table()
            if name != "adversarial_future":
                assert p.fraction_affected == pytest.approx(1 / (T - 1)), report.table()


def test_a_leak_from_the_next_position_is_found_at_every_cut():
    """Output t reads input t + 1: every one of the T - 1 cuts moves, first at position 0, in the
    random futures and the Jacobian (which must read the position right after the cut)."""
    for seed in SEEDS[:2]:
        report = audit(NextTokenLeak(seed=seed), example(seed), seed=seed, modes=("eval",))
        assert report.probe("adversarial_future", "eval").leaks, report.table()
        for name in ("random_future", "jacobian"):
            p = report.probe(name, "eval")
            assert p.leaks and p.leaking_positions == list(range(T - 1)), report.table()
            assert p.fraction_affected == 1.0, report.table()
        assert report.probe("jacobian", "eval").max_abs_delta == pytest.approx(0.5), report.table()


def test_a_prefix_that_differs_only_at_its_last_position_is_not_decode_consistent():
    """Nothing moves under future perturbations and other samples change nothing, but each prefix
    alone gives its last position another output than the full sequence does: the decode probe
    must compare that position too, and report it."""
    report = audit(LastPositionDoubled(seed=0), example(0), seed=0)
    assert not report.leaks and report.batch_invariant, report.table()
    assert report.decode_differs_in == ["train", "eval"], report.table()
    for mode in ("train", "eval"):  # each of the compared prefixes differs at its own last position
        p = report.probe("decode_consistency", mode)
        assert p.comparisons == len(p.leaking_positions) == DECODE_PREFIXES, report.table()


def test_train_only_leak_is_reported_in_train_mode_only():
    for seed in SEEDS:
        target = SequenceMeanLeak(0.1, seed=seed, train_only=True)
        report = audit(target, example(seed), seed=seed)
        assert report.leaks and report.leaks_in == ["train"], report.table()
        assert target.training, "the audit must restore the training flag"


@pytest.mark.parametrize("priority", ["score", "choice"])
def test_adversarial_probe_catches_what_random_perturbation_misses(priority):
    """With capacity 14 of 16 tokens, random futures rarely push a token over the cut-off;
    flooding the earlier tokens' experts does, for the router and for an opaque wrapper of it
    (which gets scaled copies and the gradient search instead of gate vectors)."""
    for seed in SEEDS:
        r = router("capacity", seed, top_k=2, priority=priority, capacity_factor=1.75).eval()
        for target in (r, lambda x, r=r: r(x).dense()):
            report = audit(target, example(seed, 32), seed=seed, modes=("eval",))
            assert report.probe("adversarial_future", "eval").leaks, report.table()


def test_dropout_noise_is_not_a_leak():
    """Dropout in train mode: every compared forward of the example's shape has the same seed, so
    the same noise (the seeded regime: random, not "deterministic"); the sample run alone is
    judged by distribution. Eval mode draws nothing."""
    torch.manual_seed(0)
    target = nn.Sequential(nn.Linear(D, 32), nn.Dropout(0.5), nn.Linear(32, D))
    report = audit(target, example(0), seed=0)
    assert not report.leaks and report.batch_invariant, report.table()
    assert report.regimes == {"train": "seeded", "eval": "deterministic"}, report.table()
    assert report.probe("batch_interference", "train").p_value is not None, report.table()
    assert "random in train mode: the same seed and input shape give the same draws" in report.summary()


# -- claims --------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", builtin_targets(), ids=lambda t: t.name)
def test_builtin_claims_hold_both_ways(target):
    """A false claim fails: causal / batch-invariant claims must survive the audit, and claims of
    a leak or of batch interference must be demonstrated by it."""
    report = audit(target.build(), target.example(), name=target.name)
    assert report.claims is not None
    assert not report.violations, report.table()
    assert not report.unshown, report.table()


class _LyingRouter(ExpertChoiceRouter):
    """Expert choice that claims to be causal and batch-invariant (group="batch")."""

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True)


def test_false_claims_are_violations():
    torch.manual_seed(0)
    report = audit(_LyingRouter(32, 4, group="batch"), example(0, 32))
    assert report.violations == [
        "claims causal in train mode but leaks",
        "claims causal in eval mode but leaks",
        "claims batch-invariant but other samples change its outputs",
    ]
    assert not report.claims_hold


class _DecodeLiar(CapacityRouter):
    """Capacity sized from the whole sequence that claims decode consistency."""

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)


def test_false_decode_consistency_claim_is_a_violation():
    torch.manual_seed(0)
    report = audit(_DecodeLiar(32, 4, capacity_factor=1.0), example(0, 32))
    assert not report.leaks and report.decode_differs_in == ["train", "eval"]
    assert report.violations == [
        "claims decode-consistent in train mode but prefix-only forwards differ",
        "claims decode-consistent in eval mode but prefix-only forwards differ",
    ]


def test_model_claims_combine_its_routers():
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny", router="ec_predictor", moe_every=1))
    report = audit(model, token_model("topk", 0)[1], modes=("eval",), trials=1)
    assert report.claimed_causal == {"eval": True}
    assert report.claims == Claims(causal_train=False, causal_eval=True, batch_invariant=True, decode_consistent=True)
    dense = MoETransformer(preset("tiny", moe_every=0))
    assert audit(dense, token_model("topk", 0)[1], modes=("eval",), trials=1).claims.causal_train


class DeclaredPrefixMean(PrefixMean):
    """A user's module declaring its claims as MoELayer and MoETransformer do."""

    claims = Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)


def test_our_layer_and_model_declare_claims_as_any_module_can():
    """The audit reads a module's ``claims``: a user's, ours (moe.audit.target imports neither
    MoELayer nor MoETransformer); a user's module that declares none but holds our layer gets
    each claim where every router inside makes it, as the layer itself declares."""
    report = audit(DeclaredPrefixMean(), example(0), modes=("eval",))
    assert report.claims == DeclaredPrefixMean.claims and report.claims_hold, report.table()
    layer = MoELayer(16, 32, 4, router="ec_predictor")
    assert layer.claims == Claims(causal_train=False, causal_eval=True, batch_invariant=True, decode_consistent=True)
    held = nn.Sequential(nn.Identity(), layer)
    assert audit(held, example(0), modes=("eval",), trials=1).claims == layer.claims
    source = (Path(__file__).parents[1] / "moe" / "audit" / "target.py").read_text()
    assert "moe.layer" not in source and "moe.model" not in source


def test_opaque_target_has_no_claims():
    report = audit(PrefixMean(), example(0), modes=("eval",))
    assert report.claims is None and report.claimed_causal is None and not report.violations


# -- state, report, errors -------------------------------------------------------------------
def test_target_state_and_rng_are_restored():
    """ec_threshold accumulates statistics in train-mode forwards; the audit must leave none."""
    r = router("ec_threshold", 0)
    r.train()
    before = {k: v.clone() for k, v in r.state_dict().items()}
    rng = torch.get_rng_state()
    audit(r, example(0, 32))
    assert r.training
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in r.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed: {before[k]} -> {v}"
    r.update_after_step()
    assert torch.equal(r.ema_weight, before["ema_weight"]), "pending statistics leaked out of the audit"


def test_routing_flips_are_exact_and_counted():
    """A router is compared through its exact assignments: every flip is counted."""
    report = audit(router("expert_choice", 0), example(0, 32), modes=("eval",))
    random_probe = report.probe("random_future", "eval")
    assert random_probe.routing_flips > 0 and random_probe.leaks
    # Dense weights move by a whole softmax probability when a slot is lost.
    assert random_probe.max_abs_delta > 0.05


def test_report_json_and_table():
    report = audit(SinglePositionLeak(), example(0), name="single")
    data = json.loads(report.to_json())
    (entry,) = data["targets"]
    assert entry["name"] == "single" and entry["claimed_causal"] is None
    assert entry["leaks"] is True and entry["leaks_in"] == ["train", "eval"] and entry["batch_invariant"] is True
    names = {(p["name"], p["mode"]) for p in entry["probes"]}
    assert names == {
        (n, m) for n in (*FUTURE_PROBES, "batch_interference", "decode_consistency") for m in ("train", "eval")
    }
    for p in entry["probes"]:
        assert set(p) >= {"name", "mode", "leaks", "max_abs_delta", "first_leaking_position"}
        if p["name"] in FUTURE_PROBES:
            assert p["first_leaking_position"] == LEAK_TO
    text = report.table()
    assert "LEAKS" in text and "jacobian" in text
    row = summary_table([report]).splitlines()[2]
    assert row.split()[:3] == ["single", "?", "train,eval"]


def test_token_ids_and_tuple_outputs():
    """Token ids are resampled below the embedding size; the Jacobian is taken at the embedding."""
    model, idx = token_model("topk", 0)
    report = audit(model, idx, modes=("eval",), trials=1)
    assert not report.leaks and report.probe("jacobian", "eval") is not None, report.table()
    layer = MoELayer(32, 64, 4, router="capacity", priority="score", capacity_factor=1.0)
    report = audit(lambda x: layer(x, return_routing=True), example(0, 32), modes=("eval",), trials=1)
    assert report.leaks


@pytest.mark.parametrize(
    "target, x, match",
    [
        (PrefixMean(), torch.randn(2, 1, 4), "T >= 2"),
        (PrefixMean(), [1.0, 2.0], "torch.Tensor"),
    ],
)
def test_usage_errors(target, x, match):
    with pytest.raises(AuditUsageError, match=match):
        audit(target, x)


@pytest.mark.parametrize(
    "target, match",
    [
        (lambda x: x.mean(1), r"shape \(2, 4\).*\[B, T, \.\.\.\]"),
        (lambda x: "nope", "returned str"),
    ],
)
def test_unreadable_outputs_are_reported_not_raised(target, match):
    report = audit(target, torch.randn(2, 8, 4))
    assert report.error is not None and re.search(match, report.error), report.error
    assert json.loads(report.to_json())["targets"][0]["leaks"] is None


def test_bad_modes_and_trials():
    with pytest.raises(AuditUsageError, match="unknown mode"):
        audit(PrefixMean(), example(0), modes=("test",))
    with pytest.raises(AuditUsageError, match="trials"):
        audit(PrefixMean(), example(0), trials=0)


class SecondSampleReadsFirstSample(PositionwiseMLP):
    """Sample 1's output at t also reads sample 0's input at t (same position: no future leak,
    but interference that lands on neither sample 0 nor the last sample, which the batch probe
    watches when it changes the other samples)."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        if x.shape[0] > 1:
            y[1] = y[1] + 0.5 * x[0]
        return y


def test_batch_interference_landing_on_another_sample_is_found():
    for seed in SEEDS:
        report = audit(SecondSampleReadsFirstSample(seed=seed), example(seed), seed=seed)
        assert not report.batch_invariant and not report.leaks, report.table()
        p = report.probe("batch_interference", "eval")
        assert p.found_by is not None and "compared at the other samples" in p.found_by, report.table()


class RoundRobinByFlatIndex(nn.Module):
    """Token (b, t) to expert (b * T + t) mod E, whatever it holds, as OLMo-core's and
    torchtitan's uniform-assignment options route: no future leak, and every sample keeps its
    experts when content changes, but sample b alone starts at expert 0, not at b * T mod E
    (E = 5: samples 1-3 move; E = 3: samples 1 and 2, not the last, 48 mod 3 = 0)."""

    def __init__(self, d: int = D, experts: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w_EDD = nn.Parameter(torch.randn(experts, d, d))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        expert_BT = (torch.arange(b * t) % self.w_EDD.shape[0]).view(b, t)
        return torch.einsum("btd,btde->bte", x, self.w_EDD[expert_BT])


@pytest.mark.parametrize("experts", [5, 3])
def test_a_route_read_from_the_flat_index_is_not_batch_invariant(experts):
    """On a84d900 "batch-invariant: yes": every batch variant kept each watched sample at its
    index; with the last sample alone added (2256a9d), still yes at E = 3."""
    report = audit(RoundRobinByFlatIndex(experts=experts), example(0))
    assert not report.leaks and report.batch_invariant is False, report.table()
    for mode in ("train", "eval"):
        assert report.probe("batch_interference", mode).found_by == "sample 1 alone", report.table()


# -- the probe registry ------------------------------------------------------------------------
def _reversed_future(ctx):
    """Positions after each cut reversed in time: a probe written outside the package."""
    for c in [c for c in ctx.cuts if c % 4 == 1]:
        yield ctx.with_future(c, ctx.x[:, c + 1 :].flip(1), f"positions > {c} reversed")


def test_a_probe_registered_from_outside_runs_and_is_counted():
    from moe.audit.comparator import ALPHA, MAX_DISTRIBUTION_COMPARISONS
    from moe.audit.probes import Probe, register_probe, registered_probes, unregister_probe

    before = audit(SinglePositionLeak(seed=0), example(0), modes=("eval",))
    builtin = sum(p.compares_forwards for p in registered_probes())
    assert before.per_comparison_alpha == pytest.approx(ALPHA / ((MAX_DISTRIBUTION_COMPARISONS + 1) * builtin))
    register_probe(Probe("reversed_future", "future", variants=_reversed_future))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_probe(Probe("reversed_future", "future", variants=_reversed_future))
        report = audit(SinglePositionLeak(seed=0), example(0), modes=("eval",))
    finally:
        unregister_probe("reversed_future")
    p = report.probe("reversed_future", "eval")
    assert p is not None and p.ran and p.comparisons == 4 and p.kind == "future", report.table()
    # Reversing positions > LEAK_TO moves input LEAK_FROM: the leak into LEAK_TO is seen.
    assert p.leaks and LEAK_TO in p.leaking_positions, report.table()
    assert report.per_comparison_alpha == pytest.approx(ALPHA / ((MAX_DISTRIBUTION_COMPARISONS + 1) * (builtin + 1)))
    assert [q.name for q in report.probes][-1] == "reversed_future"
    assert audit(SinglePositionLeak(seed=0), example(0), modes=("eval",)).probe("reversed_future", "eval") is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "", "kind": "future", "variants": _reversed_future}, "non-empty name"),
        ({"name": "p", "kind": "sideways", "variants": _reversed_future}, "kind must be one of"),
        ({"name": "p", "kind": "future"}, "exactly one of"),
    ],
)
def test_bad_probe_declarations(kwargs, match):
    from moe.audit.probes import Probe

    with pytest.raises(ValueError, match=match):
        Probe(**kwargs)
