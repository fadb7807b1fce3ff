"""The training frameworks' routers in the zoo against verdicts stated from reading their code.

Versions read: megatron-core 0.16.1 (``megatron/core/transformer/moe/moe_utils.py``, ``router.py``),
deepspeed 0.19.8 (``deepspeed/moe/sharded_moe.py``), fairscale 0.4.13
(``fairscale/nn/moe/top2gate.py``), torchtitan 0.3.0 (``torchtitan/models/common/moe.py``).
Each framework is skipped when not installed, and fails when installed but not importable (a
requirement of its own missing). The default suite audits the quick
deterministic configurations; every configuration is a ``slow`` test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from extras import reason
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)

from moe.audit.zoo import FRAMEWORKS, audit_framework, zoo_markdown
from moe.audit.zoo.frameworks import unavailable


@dataclass(frozen=True)
class Expect:
    """The verdict read from the code, in both modes (tests/test_zoo.py uses it too)."""

    leaks_in: tuple[str, ...]
    batch_invariant: bool
    decode_consistent: bool
    why: str
    runs: bool = True
    """False: the zoo cannot build or call it standalone (``why`` says why)."""


BOTH = ("train", "eval")
CLEAN = ((), True, True)

EXPECTED: dict[str, Expect] = {
    "TopKRouter.routing top-2 softmax, dropless": Expect(
        *CLEAN, "topk_routing_with_score_function: top-k of each token's own logits, no capacity factor: nothing drops"
    ),
    "TopKRouter.routing top-2 softmax, dropless, aux loss": Expect(
        *CLEAN,
        "MoEAuxLossAutoScaler passes the probabilities through and gives the Switch loss, a statistic of the whole "
        "micro-batch, a gradient in backward: no value reads another token (the Jacobian subtracts that gradient)",
    ),
    "TopKRouter.routing top-2 sigmoid + expert_bias, 2 groups (group_topk=1), dropless": Expect(
        *CLEAN, "group_limited_topk picks groups from the token's own scores + the fixed expert_bias; no capacity"
    ),
    "TopKRouter.routing top-2 cf=1 drop_policy=probs": Expect(
        BOTH,
        False,
        False,
        "apply_router_token_dropping: torch.topk(routing_probs, k=capacity, dim=0) keeps each expert's C most "
        "probable tokens of the whole micro-batch, so a later token with a higher probability evicts an earlier one",
    ),
    "TopKRouter.routing top-2 cf=1 drop_policy=probs pad_to_capacity": Expect(
        BOTH, False, False, "pad_to_capacity only widens the expert input: the same topk over dim 0 decides who is kept"
    ),
    "TopKRouter.routing top-2 cf=1 drop_policy=position": Expect(
        BOTH,
        False,
        False,
        "torch.topk(routing_map.int(), k=capacity, dim=0) picks C of the routed tokens among equal 1s; torch.topk does "
        "not keep the earliest of tied values (on CPU it does not), so which earlier tokens stay depends on later ones",
    ),
    "TopKRouter.routing top-2 cf=2.5 drop_policy=probs": Expect(
        *CLEAN,
        "get_capacity gives ceil(16 * 2 / 4 * 2.5) = 20 > 16 tokens: the 'expert_capacity > num_tokens' branch keeps all",
    ),
    "TopKGate k=1 cf=1 use_rts (default)": Expect(
        BOTH,
        False,
        False,
        "top1gating with use_rts: mask1 * uniform priorities, topk(k=capacity, dim=0) over all B*T tokens keeps the C "
        "highest random priorities, so a later token can take an earlier one's slot; C = ceil(S / E) shrinks with a "
        "prefix (seen by distribution: the random selection is drawn again for every shape)",
    ),
    "TopKGate k=1 cf=1 use_rts=False": Expect(
        BOTH,
        False,
        False,
        "top1gating without RTS: topk over the 0/1 mask picks C of the tokens routed to an expert among tied 1s, "
        "not the first C, over the b-major flattened batch",
    ),
    "TopKGate k=1 drop_tokens=False": Expect(
        *CLEAN, "capacity = max(exp_counts): every token keeps its argmax expert; the slot count only pads"
    ),
    "TopKGate k=2 cf=1": Expect(
        BOTH,
        False,
        False,
        "top2gating: locations2 += torch.sum(mask1, dim=0) queues every second choice behind all first choices of the "
        "B*T tokens, so a later token's first choice evicts an earlier second choice; C = ceil(S / E * 2) shrinks "
        "with a prefix",
    ),
    "TopKGate k=2 cf=1 train, eval_capacity_factor=4": Expect(
        ("train",),
        False,
        False,
        "TopKGate.forward passes capacity_factor when training, eval_capacity_factor=4 otherwise: C = 32 >= every "
        "expert's count in eval (decode differs in train only)",
    ),
    "TopKGate k=2 drop_tokens=False": Expect(
        *CLEAN,
        "top2gating with drop_tokens=False: capacity = max(exp_counts), nothing dropped; the Gumbel second expert "
        "is per token",
    ),
    "TopKGate k=3 cf=1 (topkgating, drop_policy=probs)": Expect(
        BOTH,
        False,
        False,
        "topkgating drop_policy='probs': topk(topk_masked_gates, k=capacity, dim=0) keeps each expert's C highest gates "
        "over the B*T tokens",
    ),
    "Top2Gate": Expect(
        BOTH,
        False,
        False,
        "fairscale top2gating: capacity 2S/E and locations2 += sum(mask1): second choices after all first choices; "
        "the capacity shrinks with a prefix (seen by distribution: the Gumbel second expert is sampled in both modes)",
    ),
    "TokenChoiceTopKRouter softmax top-2": Expect(
        *CLEAN, "topk(scores_for_choice_BLE, dim=-1) of the token's own softmax"
    ),
    "TokenChoiceTopKRouter sigmoid top-2 + expert_bias, route_norm": Expect(
        *CLEAN, "expert_bias_E is a buffer the optimizer hook updates, fixed within a forward; route_norm is over the k"
    ),
    "TokenChoiceTopKRouter sigmoid top-2, node-limited (2 groups, 1 kept)": Expect(
        *CLEAN, "_get_node_limited_routing_scores ranks groups by the token's own top-2 scores"
    ),
    "TokenChoiceTopKRouter _debug_force_load_balance": Expect(
        (),
        True,
        False,
        "_debug_force_load_balance_routing: expert = arange(B * L * K) % E, a function of the flat index b * L + t "
        "only: causal, but a prefix of another length L' gives sample b >= 1 other experts",
    ),
}

FAST = (
    "TopKRouter.routing top-2 cf=1 drop_policy=probs",
    "TopKRouter.routing top-2 cf=1 drop_policy=position",
    "TopKRouter.routing top-2 softmax, dropless, aux loss",
    "TopKGate k=1 cf=1 use_rts=False",
    "TokenChoiceTopKRouter softmax top-2",
    "TokenChoiceTopKRouter _debug_force_load_balance",
)
"""Deterministic, quick configurations (one per verdict kind) for the default suite."""


def test_every_configuration_has_an_expectation_and_three_frameworks_at_least():
    assert sorted(fc.name for fc in FRAMEWORKS) == sorted(EXPECTED)
    assert len({fc.library for fc in FRAMEWORKS}) >= 3


def _check(name: str) -> None:
    fc = next(f for f in FRAMEWORKS if f.name == name)
    why = unavailable(fc.library)
    if why is not None and "is not installed" in why:
        pytest.skip(reason(fc.library, "zoo-frameworks"))
    assert why is None, why  # installed but broken (deepspeed without einops): a failure, never a skip
    row = audit_framework(fc)
    exp = EXPECTED[name]
    assert row.error is None, f"{name}: {row.error}"
    rep = row.report
    got = (tuple(rep.leaks_in), rep.batch_invariant, rep.decode_consistent)
    assert got == (exp.leaks_in, exp.batch_invariant, exp.decode_consistent), (
        f"{name}: audit found leaks in {got[0]}, batch-invariant {got[1]}, decode-consistent {got[2]}; "
        f"the code says {exp}\n{rep.table()}"
    )
    assert f"`{name}`" in zoo_markdown([row])


@pytest.mark.parametrize("name", FAST)
def test_framework_configuration_quick(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_framework_configuration(name):
    _check(name)


def test_missing_framework_is_a_row_not_a_failure(monkeypatch):
    from moe.audit.zoo import run

    monkeypatch.setattr(run, "unavailable", lambda library: f"{library} is not installed (pip install ...)")
    row = run.audit_framework(FRAMEWORKS[0])
    assert row.report is None and "not installed" in row.error and "not run" in zoo_markdown([row])


def test_an_installed_framework_that_cannot_be_imported_says_why(monkeypatch):
    """deepspeed 0.19.8 imports einops at import time; without it the row (and the test's skip
    reason) said "not installed", which hid that CI skipped every DeepSpeed row."""
    from moe.audit.zoo import frameworks

    monkeypatch.setattr(frameworks.importlib.metadata, "version", lambda library: "0.19.8")
    monkeypatch.setitem(frameworks._IMPORT_NAME, "deepspeed", "a_module_that_does_not_exist_here")
    why = frameworks.unavailable("deepspeed")
    assert why.startswith("deepspeed is installed but cannot be imported (ModuleNotFoundError: No module named"), why
