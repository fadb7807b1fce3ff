"""How the audit reads the fields a block returns: a flattened field in the order its rows follow,
and a field that is None (or not a tensor) named as not audited, never a reason to stop.

On 7dc4c10 a pre-gated block (token t routed from token t-1's hidden state) that returns its
router logits flattened time-major ([T * B, E], Megatron's order) was called LEAKS in both modes
and not batch-invariant: the one forward that changed the last position moved no row of its
logits (no token is routed from the last one), the audit then printed "a change at the last
position moved other rows too", which it had not seen, and read the field as rows b * T + t.
A field that is None before a leaking one was skipped without a word.

Shapes: B=4, T=16, D=8, E=4.
"""

from __future__ import annotations

import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit

B, T, D, E = 4, 16, 8, 4
SEEDS = range(2)


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


class PreGatedSequenceMajorFirst(nn.Module):
    """A pre-gated top-1 block computed time-major, as Megatron-style code runs: the input is
    transposed to [T, B, D]; token t is routed by the gate applied to token t - 1 (a zero vector
    for t = 0), so the routing of a token is known one step ahead; it returns the hidden states
    [B, T, D], the router logits [T * B, E] and the chosen experts [T * B] (int64), both flattened
    in the [T, B] order its dispatcher uses. Causal and batch-invariant."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / D**0.5)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x_TBD = hidden_states.transpose(0, 1)
        t, b, _ = x_TBD.shape
        previous_TBD = torch.cat([torch.zeros_like(x_TBD[:1]), x_TBD[:-1]])
        logits_TBE = self.gate(previous_TBD)
        expert_TB = logits_TBE.argmax(-1)
        y_TBD = torch.tanh(torch.einsum("tbd,tbde->tbe", x_TBD, self.w_EDD[expert_TB]))
        return y_TBD.transpose(0, 1), logits_TBE.reshape(t * b, E), expert_TB.reshape(t * b)


def test_a_pre_gated_time_major_block_is_read_in_its_order_and_clean():
    for seed in SEEDS:
        report = audit(PreGatedSequenceMajorFirst(seed), example(seed), seed=seed)
        assert report.error is None and not report.leaks and report.batch_invariant, report.summary()
        assert report.outputs[1:] == ["1 [64, 4] (rows t*B+b)", "2 [64] (rows t*B+b)"], report.outputs
        assert all("other rows too" not in n for n in report.notes), report.notes
        assert any(n.startswith("1: rows are t*B+b") for n in report.notes), report.notes


class SequenceNormalisedLoad(nn.Module):
    """A dropless top-1 block returning (hidden, None, aux) as blocks do whose second field is only
    filled in when asked for (``output_router_logits=False``): aux is the routing probability of
    each token normalised over its whole sequence (a load-balancing statistic), which reads every
    later token. ``as_dict``: {"hidden", "router_logits": None, "aux"} instead."""

    def __init__(self, seed: int, as_dict: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / D**0.5)
        self.as_dict = as_dict

    def forward(self, hidden_states: Tensor):
        logits_BTE = self.gate(hidden_states)
        expert_BT = logits_BTE.argmax(-1)
        y_BTD = torch.tanh(torch.einsum("btd,btde->bte", hidden_states, self.w_EDD[expert_BT]))
        aux_BTE = logits_BTE.exp() / logits_BTE.exp().sum(dim=1, keepdim=True)
        if self.as_dict:
            return {"hidden": y_BTD, "router_logits": None, "step": 3, "aux": aux_BTE}
        return y_BTD, None, aux_BTE


def test_a_none_field_before_a_leaking_one_is_named_and_the_leak_found():
    report = audit(SequenceNormalisedLoad(0), example(), modes=("eval",))
    assert report.leaks and report.leaks_in == ["eval"], report.summary()
    leaking = {o for p in report.probes if p.leaks for o in p.leaking_outputs}
    assert leaking == {"2"}, leaking
    assert report.outputs_not_audited == ["1 (None: nothing returned in it)"], report.outputs_not_audited
    assert "not audited, with why: 1 (None: nothing returned in it)" in report.summary()


def test_a_dict_with_a_none_and_a_number_names_both():
    report = audit(SequenceNormalisedLoad(0, as_dict=True), example(), modes=("eval",))
    assert report.leaks and {o for p in report.probes if p.leaks for o in p.leaking_outputs} == {"aux"}
    assert report.outputs_not_audited == [
        "router_logits (None: nothing returned in it)",
        "step (int, not a tensor)",
    ], report.outputs_not_audited


def test_the_header_names_the_leaking_outputs_and_a_deselected_one_says_so():
    report = audit(SequenceNormalisedLoad(0), example(), modes=("eval",))
    assert report.summary().splitlines()[0] == "SequenceNormalisedLoad: LEAKS in eval mode in 1 of 2 outputs: 2"
    picked = audit(SequenceNormalisedLoad(0), example(), modes=("eval",), output="2")
    assert picked.outputs_not_audited == [
        "0 [4, 16, 8] (not selected by --output (output=))",
        "1 (not selected by --output (output=))",
    ], picked.outputs_not_audited
