"""Targets that return several outputs: every per-position output is audited and named, or the
audit refuses in one line. On main 1de3896 only the first tensor (or ``logits``) was judged, so
a leak in any other output was reported as "no leak found".

The targets are MoE blocks the way libraries write them: a block returning its hidden states
with the router logits it computed (as Hugging Face blocks return them, flattened to [B * T, E]
for the balance loss), a dict of outputs, a model output with a loss, logits and per-layer
router logits. Shapes: B=4, T=16, D=8, E=4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from test_audit_targets import ModelOutputLike
from torch import Tensor, nn

from moe.audit import audit, cli

B, T, D, E = 4, 16, 8, 4
SEEDS = range(3)


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


class TopOneBlock(nn.Module):
    """Dropless top-1: each token's own gate logits pick its expert (causal). Returns (hidden,
    router_logits_NE) like a Hugging Face MoE block. ``balance_logits="sequence"``: the logits it
    returns for the balance loss are log-probabilities normalised over each sequence's tokens (a
    softmax over the time axis, as a "load per expert" loss wants them), which read every later
    token: the routing stays causal, the second output leaks."""

    def __init__(self, seed: int, balance_logits: str = "token") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(E, D, D) / D**0.5)
        self.balance_logits = balance_logits

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        b, t, d = hidden_states.shape
        logits_BTE = self.gate(hidden_states)
        expert_BT = logits_BTE.argmax(-1)
        y_BTD = torch.tanh(torch.einsum("btd,btde->bte", hidden_states, self.w_EDD[expert_BT]))
        if self.balance_logits == "sequence":
            logits_BTE = logits_BTE.log_softmax(dim=1)
        return y_BTD, logits_BTE.reshape(b * t, -1)


class DictBlock(TopOneBlock):
    """{"hidden": causal, "aux": the hidden state minus its mean over the sequence (reads the
    future), "loss": a scalar}."""

    def forward(self, hidden_states: Tensor) -> dict[str, Tensor]:
        y_BTD, _ = super().forward(hidden_states)
        return {"hidden": y_BTD, "aux": y_BTD - y_BTD.mean(dim=1, keepdim=True), "loss": y_BTD.square().mean()}


@dataclass
class MoECausalLMOutput(ModelOutputLike):
    loss: Tensor | None = None
    logits: Tensor | None = None
    router_logits: tuple[Tensor, ...] | None = None


class TwoLayerModel(nn.Module):
    """Two TopOneBlocks (residual) and a head; returns a model output with a scalar loss, the
    logits and each layer's router logits. ``leaky_layer``: the layer whose returned router
    logits are normalised over the sequence (None: neither)."""

    def __init__(self, seed: int, leaky_layer: int | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TopOneBlock(seed + i, "sequence" if i == leaky_layer else "token") for i in range(2)
        )
        self.head = nn.Linear(D, 16)

    def forward(self, x_BTD: Tensor) -> MoECausalLMOutput:
        h, router_logits = x_BTD, []
        for layer in self.layers:
            y, logits = layer(h)
            h = h + y
            router_logits.append(logits)
        logits = self.head(h)
        return MoECausalLMOutput(loss=logits.logsumexp(-1).mean(), logits=logits, router_logits=tuple(router_logits))


def test_a_leak_in_the_second_output_is_found_and_named():
    for seed in SEEDS:
        report = audit(TopOneBlock(seed, "sequence"), example(seed), seed=seed)
        assert report.leaks_in == ["train", "eval"], report.table()
        assert report.outputs == ["0 [4, 16, 8]", "1 [64, 4] (rows b*T+t)"], report.outputs
        for p in report.probes:
            if p.leaks and p.kind == "future":
                assert p.leaking_outputs == ["1"], report.table()
        summary = report.summary()
        assert summary.splitlines()[0] == "TopOneBlock: LEAKS in train, eval mode in 1 of 2 outputs: 1", summary
        assert "audited: 0 [4, 16, 8]; 1 [64, 4] (rows b*T+t)" in summary, summary
        assert "found by random_future (train): 1 at positions" in summary, summary
        assert "outputs moved" in report.table()


def test_router_logits_of_a_causal_block_are_audited_and_clean():
    for seed in SEEDS:
        report = audit(TopOneBlock(seed), example(seed), seed=seed)
        assert report.error is None and not report.leaks and report.batch_invariant, report.table()
        assert len(report.outputs) == 2 and report.notes == [], report.summary()


def test_dict_outputs_name_the_leaking_field_and_skip_the_scalar():
    report = audit(DictBlock(0), example(), modes=("eval",))
    assert report.leaks_in == ["eval"], report.table()
    assert report.probe("random_future", "eval").leaking_outputs == ["aux"], report.table()
    assert report.outputs == ["hidden [4, 16, 8]", "aux [4, 16, 8]"], report.outputs
    assert report.outputs_not_audited == ["loss [] (a scalar: a loss or a statistic of the whole batch)"]
    data = json.loads(report.to_json())["targets"][0]
    assert data["outputs"] == report.outputs and data["outputs_not_audited"] == report.outputs_not_audited
    assert "not audited, with why: loss []" in report.summary(), report.summary()


class AuxInTraining(TopOneBlock):
    """(hidden, router logits [B, T, E] in training only, a scalar balance loss in training and
    None in eval), as OLMo-core's router and JetMoE's gate return their losses."""

    def forward(self, x: Tensor):
        hidden, logits_NE = super().forward(x)
        if not self.training:
            return hidden, None, None
        return hidden, logits_NE.view(*x.shape[:2], -1), logits_NE.softmax(-1).mean().square()


def test_outputs_a_mode_gives_alone_are_listed_with_their_mode():
    """On a84d900 the listing was the last mode's: "not audited: 2 (None: nothing returned in it)"
    beside a training-mode loss, and the router logits audited in training were not named."""
    report = audit(AuxInTraining(0), example())
    assert report.outputs == ["0 [4, 16, 8]", "1 [4, 16, 4] in train mode"], report.outputs
    assert report.outputs_not_audited == [
        "2 [] (a scalar: a loss or a statistic of the whole batch) in train mode",
        "1 (None: nothing returned in it) in eval mode",
        "2 (None: nothing returned in it) in eval mode",
    ], report.outputs_not_audited
    assert not report.leaks, report.table()


@pytest.mark.parametrize("leaky_layer", [None, 1])
def test_model_output_with_per_layer_router_logits(leaky_layer):
    report = audit(TwoLayerModel(0, leaky_layer), example(), modes=("eval",))
    assert report.outputs == [
        "logits [4, 16, 16]",
        "router_logits.0 [64, 4] (rows b*T+t)",
        "router_logits.1 [64, 4] (rows b*T+t)",
    ], report.outputs
    if leaky_layer is None:
        assert not report.leaks, report.table()
    else:
        assert report.leaks_in == ["eval"], report.table()
        assert report.probe("random_future", "eval").leaking_outputs == ["router_logits.1"], report.table()


def test_output_selects_fields_and_their_children():
    """``output=`` keeps the named fields (a name keeps everything under it); a name the output
    does not have is a one-line error that lists what it has."""
    target = TwoLayerModel(0, leaky_layer=1)
    only_logits = audit(target, example(), modes=("eval",), output="logits")
    assert only_logits.outputs == ["logits [4, 16, 16]"] and not only_logits.leaks, only_logits.table()
    routers = audit(target, example(), modes=("eval",), output="router_logits")
    assert [o.split()[0] for o in routers.outputs] == ["router_logits.0", "router_logits.1"] and routers.leaks
    missing = audit(target, example(), modes=("eval",), output="hidden")
    assert missing.error is not None and "has no field 'hidden'" in missing.error
    assert "logits, router_logits.0, router_logits.1" in missing.error, missing.error


class TimeMajorRouterLogits(TopOneBlock):
    """A Megatron-style block: works on [T, B, D] and returns its router logits flattened in
    that order ([T * B, E], row t * B + b): causal, read right only in that order."""

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        y_BTD, logits_NE = super().forward(hidden_states)
        b, t, _ = hidden_states.shape
        logits_TBE = logits_NE.reshape(b, t, -1).transpose(0, 1)
        return y_BTD, logits_TBE.reshape(t * b, -1)


def test_a_time_major_flattening_is_found_and_read_in_its_order():
    """Read as rows b * T + t, a causal time-major output would move at earlier positions when a
    later one changes: a false leak. The audit checks the order with one forward."""
    report = audit(TimeMajorRouterLogits(0), example(), modes=("eval",))
    assert report.error is None and not report.leaks, report.table()
    assert report.outputs[1] == "1 [64, 4] (rows t*B+b)", report.outputs
    assert report.notes == [
        "1: rows are t*B+b (time-major): a change at position 15 alone moved rows at positions >= 15 only when "
        "read so (read as b*T+t, rows before 15 moved)"
    ], report.notes


class TimeMajorHidden(TopOneBlock):
    """Returns its hidden states as [T, B, D] beside the [B, T, D] ones."""

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        y_BTD, _ = super().forward(hidden_states)
        return y_BTD, y_BTD.transpose(0, 1)


def test_an_output_the_audit_cannot_read_is_refused_in_one_line(tmp_path, capsys):
    report = audit(TimeMajorHidden(0), example(), modes=("eval",))
    assert report.error is not None and "time-major [T=16, B=4, ...]" in report.error, report.error
    assert "--output" in report.error and report.leaks_in == [], report.error
    file = tmp_path / "block.py"
    file.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * 2, (x * 2).transpose(0, 1)\n\n"
        "block = Block()\n"
    )
    assert cli.main(["--target", f"{file}:block", "--input", "float:4,16,8", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "--output" in captured.err, captured.err
    assert cli.main(["--target", f"{file}:block", "--input", "float:4,16,8", "--output", "0", "--no-progress"]) == 0
