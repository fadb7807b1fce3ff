"""What the audit's report says: advice by the mechanism found, the reason beside a large change
it did not count, where a target raised, probes it skipped, and the command's lines (a
NOT AUDITED target once, on stderr; a progress line per probe on long audits, never in JSON);
and the wording issue 40 fixed: a decode line that names capacity only where the mechanism is
capacity, the built-in table's eval-only claims, the Jacobian's excess, "seeded" rather than
"deterministic" for a target whose noise depends on the batch size, a word for an output coarser
than its input, and what expert choice should do instead of decoding.

Shapes: B=4, T=16, D=16 (32 for the built-in routers), E=4.
"""

from __future__ import annotations

import inspect
import json
import math
import textwrap

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit, cli, runner
from moe.audit.report import ProbeResult, moved_without_gradient
from moe.routers import build_router

B, T, D, E = 4, 16, 16, 4


def example(seed: int = 0, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


class NoiseOfTheBatch(nn.Module):
    """x + noise drawn for the whole batch in time-major order ([T, B, D], as code that keeps
    activations time-major draws it): under one seed a sample run alone gets other noise than the
    same sample in a batch, so that comparison is one by distribution."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        return x_BTD + 0.1 * torch.randn(t, b, d).transpose(0, 1)


def test_a_large_change_beside_batch_invariant_yes_says_why():
    report = audit(NoiseOfTheBatch(), example(), modes=("eval",), name="noisy")
    batch = report.probe("batch_interference", "eval")
    line = next(s for s in report.summary().splitlines() if s.startswith("  batch-invariant:"))
    # Sample 0 alone moved by ~0.3 under the audit seed (other noise), not significant over the seeds.
    assert report.batch_invariant and batch.max_abs_delta > 0.05, report.table()
    assert batch.largest_change_p > report.test_level, report.table()
    assert line.startswith("  batch-invariant: yes; not counted: batch_interference (eval)"), line
    assert f"changed outputs by up to {batch.max_abs_delta:.3g} (sample 0 alone), not significant" in line, line
    assert f"p = {batch.largest_change_p:.0e}, above the level {report.test_level:.0e} of one test" in line, line


class MixtureOfDepths(nn.Module):
    """A Mixture-of-Depths block (each sequence's top T / 2 positions by a router's score get the
    block, the rest skip it): expert choice over positions, opaque to the audit."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(D, generator=gen))
        self.block = nn.Parameter(torch.randn(D, D, generator=gen) / math.sqrt(D))

    def forward(self, x_BTD: Tensor) -> Tensor:
        score_BT = x_BTD @ self.router
        chosen_BT = torch.zeros_like(score_BT, dtype=torch.bool)
        chosen_BT.scatter_(1, score_BT.topk(x_BTD.shape[1] // 2, dim=1).indices, True)
        update_BTD = torch.sigmoid(score_BT)[..., None] * torch.tanh(x_BTD @ self.block)
        return x_BTD + update_BTD * chosen_BT[..., None]


class RollInTime(nn.Module):
    """Reads the next position (a torch.roll over time): a look-ahead that is not a router."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        return x_BTD + 0.5 * torch.roll(x_BTD, -1, dims=1)


class MixtureOfDepthsSoftmax(MixtureOfDepths):
    """The Mixture-of-Depths block above with the chosen positions' weights a softmax over those
    positions (as kyegomez/Mixture-of-Depths and BALM's expert-choice router normalise): a
    differentiable path into later inputs among the chosen, and the discrete choice of positions
    besides it."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        score_BT = x_BTD @ self.router
        top_BK = score_BT.topk(x_BTD.shape[1] // 2, dim=1).indices
        weight_BK = torch.softmax(score_BT.gather(1, top_BK), dim=1)
        update_BTD = torch.zeros_like(x_BTD).scatter(1, top_BK[..., None].expand(-1, -1, x_BTD.shape[2]), 1.0)
        weight_BT = torch.zeros_like(score_BT).scatter(1, top_BK, weight_BK)
        return x_BTD + weight_BT[..., None] * update_BTD * torch.tanh(x_BTD @ self.block)


class SoftDispatch(nn.Module):
    """Soft-MoE's dispatch in one slot: a softmax over the tokens of each sequence averages them
    all, every output reads every position; continuous, no decision anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(0)))

    def forward(self, x_BTD: Tensor) -> Tensor:
        slot_BD = torch.einsum("bt,btd->bd", torch.softmax(x_BTD @ self.router, dim=1), x_BTD)
        return x_BTD + torch.tanh(slot_BD)[:, None]


class ExpertChoiceOverTokens(SoftDispatch):
    """BALM's expert-choice router with a shared path: the softmax over all tokens of the
    sequence weights every token, and an expert doubles its top half of them; every output has a
    gradient into every later input, and the top-half choice jumps besides."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        probs_BT = torch.softmax(x_BTD @ self.router, dim=1)
        kept_BT = torch.zeros_like(probs_BT).scatter(1, probs_BT.topk(x_BTD.shape[1] // 2, dim=1).indices, 1.0)
        return x_BTD + (probs_BT * (1 + kept_BT))[..., None] * torch.tanh(x_BTD)


def _router(name: str, **options) -> nn.Module:
    torch.manual_seed(0)
    return build_router(name, d_model=32, num_experts=E, capacity_factor=1.0, **options)


def test_advice_follows_the_mechanism():
    ec = audit(_router("expert_choice"), example(d=32), modes=("eval",)).summary()
    assert "mechanism: expert choice over positions" in ec and "use ec_threshold or ec_predictor" in ec, ec
    assert "capacity_scope" not in ec and 'moe.MoELayer(d_model, d_ff, num_experts, router="ec_threshold")' in ec
    score = audit(_router("capacity", priority="score"), example(d=32), modes=("eval",)).summary()
    assert "mechanism: capacity kept by score" in score and 'capacity_scope="prefix"' in score, score
    assert "ec_threshold" not in score, score
    roll = audit(RollInTime(), example(), modes=("eval",)).summary()
    # A module with nothing named as routing: make the path causal, no router named (see
    # test_a_sequence_mixer_with_no_router_gets_no_router_advice).
    assert "through a differentiable path" in roll and "make that computation causal" in roll, roll
    assert "no router is advised" in roll and "ec_threshold" not in roll and "MoELayer" not in roll, roll
    # Opaque expert choice over positions: the audit cannot see how it routes, so both remedies,
    # each with its condition, and how to put either into the user's block.
    mod = audit(MixtureOfDepths(), example(), modes=("eval",)).summary()
    assert "the audit cannot tell how it is routed" in mod and "If experts or a block pick their top positions" in mod
    assert 'router="ec_threshold")' in mod and 'capacity_scope="prefix")' in mod, mod


class RightPaddedConv(nn.Module):
    """A depthwise convolution over time padded on both sides and not trimmed: position t reads
    t + 1 (pytorch-tcn's causal=False, lucidrains' local attention with look_forward)."""

    def __init__(self, norm: bool = False, pad: tuple[int, int] = (1, 1)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pad, self.conv = pad, nn.Conv1d(D, D, 3, groups=D)
        self.norm = nn.BatchNorm1d(D) if norm else nn.Identity()

    def forward(self, x_BTD: Tensor) -> Tensor:
        h_BDT = self.conv(nn.functional.pad(x_BTD.transpose(1, 2), self.pad))
        return self.norm(h_BDT).transpose(1, 2)


class Top1Gate(nn.Module):
    """A gate as fairseq names one (a class ending in Gate, its weight ``wg``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wg = nn.Linear(D, 1, bias=False)


def _mean_leak(module: nn.Module) -> str:
    """The summary of a sequence mean added to x, audited as a leak of ``module`` (whose names
    alone decide whether the routers are named)."""

    class Leak(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x_BTD: Tensor) -> Tensor:
            return x_BTD + x_BTD.mean(1, keepdim=True)

    return audit(Leak(), example(), modes=("eval",), trials=1).summary()


def test_a_sequence_mixer_with_no_router_gets_no_router_advice():
    """Public non-MoE mixers that leak (local attention looking forward, a non-causal gMLP gate,
    a bidirectional S4 kernel, a TCN padded on both sides) were advised ec_threshold, ec_predictor
    or dropless topk: a module with nothing named as routing gets the causal fix alone. A callable
    shows nothing to read, and keeps the router case; a parameter named "router" keeps it too."""
    conv = audit(RightPaddedConv(), example(), modes=("eval",), trials=1).summary()
    assert "through a differentiable path" in conv and "padding on the left only" in conv, conv
    assert "no router is advised" in conv and "ec_threshold" not in conv and "router's" not in conv, conv
    plain = audit(lambda x: x + 0.5 * torch.roll(x, -1, dims=1), example(), modes=("eval",), trials=1).summary()
    assert "The audit cannot tell whether the path is a router's" in plain, plain
    soft = audit(SoftDispatch(), example(), modes=("eval",), trials=1).summary()
    assert "The audit cannot tell whether the path is a router's" in soft, soft
    for gate in (Top1Gate(), nn.ModuleDict({"wg": Top1Gate().wg})):  # fairseq's naming, or a "wg" alone
        assert "The audit cannot tell whether the path is a router's" in _mean_leak(gate), gate
    assert "no router is advised" in _mean_leak(nn.ModuleDict({"igate": nn.Linear(D, D)})), "xLSTM's igate"


class SalientPositions(nn.Module):
    """Token pruning by salience, no routing anywhere in its names: each sequence's top T / 2
    positions by a score get an update (scaled by a softmax over the kept ones with ``softmax``),
    the others none."""

    def __init__(self, softmax: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.softmax, self.salience = softmax, nn.Parameter(torch.randn(D, generator=gen))

    def forward(self, x_BTD: Tensor) -> Tensor:
        score_BT = x_BTD @ self.salience
        kept_BT = torch.zeros_like(score_BT).scatter(1, score_BT.topk(x_BTD.shape[1] // 2, dim=1).indices, 1.0)
        if self.softmax:
            kept_BT = kept_BT * torch.softmax(score_BT.masked_fill(kept_BT == 0, -math.inf), dim=1)
        return x_BTD + kept_BT[..., None] * torch.tanh(x_BTD)


@pytest.mark.parametrize("softmax", [False, True])
def test_a_choice_of_positions_with_no_router_gets_no_router_advice(softmax):
    """zoology's Nystrom attention (landmarks averaged over segments, an iterative pseudo-inverse
    whose first row reads the future with a gradient of 6e-9) moved position 0 with no gradient
    to count, and was advised ec_threshold, capacity and two MoELayer calls: a module with nothing
    named as routing is told to look for a choice over the sequence, no router."""
    summary = audit(SalientPositions(softmax), example(), modes=("eval",), trials=1).summary()
    assert "a choice over the sequence (a top-k, sort or argmax over positions" in summary, summary
    assert "no router is advised" in summary and "MoELayer" not in summary and "ec_threshold" not in summary, summary
    assert ("through a differentiable path" in summary) == softmax, summary


def test_batchnorm_over_time_is_advised_as_batch_statistics():
    """pytorch-tcn's use_norm="batch_norm" in a causal TCN: BatchNorm1d over [B, D, T] normalises
    with the batch's mean and variance over every sample and position in training (a leak there
    only, and no batch invariance), its running statistics in eval. It was advised "make that
    computation causal (a mask or a shift)", and the routers."""
    report = audit(RightPaddedConv(norm=True, pad=(2, 0)), example(), trials=1)
    assert report.leaks_in == ["train"] and report.batch_invariant is False, report.table()
    summary = report.summary()
    assert "mechanism: norm (BatchNorm) normalise with the mean and variance over every sample and position" in summary
    assert "in train mode" in summary and "LayerNorm" in summary, summary
    assert "a mask or a shift" not in summary and "router" not in summary, summary


def test_a_softmax_over_chosen_positions_is_advised_as_routing_too():
    """A nonzero Jacobian alone says "not a routing decision"; where forwards also moved outputs
    whose gradient to every later input is zero, the choice of positions is a discrete leak
    besides it, and the advice names the causal routers (found on kyegomez/Mixture-of-Depths and
    BALM's expert-choice router, whose advice said a causal router would not help)."""
    report = audit(MixtureOfDepthsSoftmax(), example(), modes=("eval",))
    jac = report.probe("jacobian", "eval")
    assert jac.leaks and jac.probed_positions == list(range(T - 1)), report.table()
    summary = report.summary()
    assert "The audit cannot tell whether the path is a router's" not in summary, summary
    assert "also moved where that gradient is zero or jumped on a straight path" in summary, summary
    assert "If experts or a block pick their top positions" in summary, summary
    assert 'moe.MoELayer(d_model, d_ff, num_experts, router="ec_threshold")' in summary, summary


class IdsMixtureOfDepths(MixtureOfDepths):
    """The Mixture-of-Depths block on token ids embedded by a plain function of the ids (a one-hot
    projection in its own forward): no submodule reads them, so the Jacobian cannot run."""

    def forward(self, ids_BT: Tensor) -> Tensor:
        x_BTD = torch.nn.functional.one_hot(ids_BT, 32).float()[..., :D] + ids_BT[..., None] / 32
        return super().forward(x_BTD)


def test_no_gradient_path_is_claimed_only_where_the_jacobian_ran():
    """Where the Jacobian did not run (here no submodule reads the ids), the advice may not say
    "no gradient path": it said so for sramshetty/mixture-of-depths, whose fairscale embedding the
    Jacobian did not read then."""
    ran = audit(MixtureOfDepths(), example(), modes=("eval",)).summary()
    assert "(a discrete change, no gradient path;" in ran, ran
    report = audit(IdsMixtureOfDepths(), torch.randint(0, 32, (B, T), generator=torch.Generator()), modes=("eval",))
    assert not report.probe("jacobian", "eval").ran and report.leaks, report.table()
    summary = report.summary()
    assert "no gradient path" not in summary and "the Jacobian did not run, see below" in summary, summary
    assert summary.index("the Jacobian did not run, see below") < summary.index("jacobian/eval did not run"), summary


class OwnEmbedding(nn.Module):
    """An embedding of another library (fairscale's ParallelEmbedding): F.embedding on a weight of
    its own, no nn.Embedding anywhere."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids_BT: Tensor) -> Tensor:
        return torch.nn.functional.embedding(ids_BT, self.weight)


class MeanOverTimeLM(nn.Module):
    """Token ids through :class:`OwnEmbedding`, plus the mean over the whole sequence: a
    differentiable leak the Jacobian reads at the embedding's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = OwnEmbedding(32, D)

    def forward(self, ids_BT: Tensor) -> Tensor:
        h_BTD = self.embed(ids_BT)
        return h_BTD + h_BTD.mean(1, keepdim=True)


def test_the_jacobian_reads_an_embedding_that_is_no_nn_embedding():
    """sramshetty/mixture-of-depths (Meta's llama code) embeds through fairscale's
    ParallelEmbedding: the Jacobian did not run there ("no gradient reaches the output from an
    nn.Embedding"). Without an nn.Embedding, the first submodule reading the ids is read."""
    ids = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(0))
    report = audit(MeanOverTimeLM(), ids, modes=("eval",))
    jac = report.probe("jacobian", "eval")
    assert jac.ran and jac.leaks and jac.leaking_positions == list(range(T - 1)), report.table()
    assert "through a differentiable path" in report.summary(), report.summary()


def test_a_jump_on_the_path_to_another_future_tells_a_choice_behind_a_softmax():
    """Where the Jacobian is nonzero at every position, the straight path from the example to a
    random future tells the two apart: a softmax over the tokens alone never jumps; the top-k
    choice behind one does (BALM's expert choice, advised before as "not a routing decision")."""
    soft = audit(SoftDispatch(), example(), modes=("eval",))
    jac = soft.probe("jacobian", "eval")
    assert jac.leaking_positions == list(range(T - 1)) and jac.jump_positions == [], soft.table()
    assert "The audit cannot tell whether the path is a router's" in soft.summary() and "MoELayer" not in soft.summary()
    chosen = audit(ExpertChoiceOverTokens(), example(), modes=("eval",))
    jac = chosen.probe("jacobian", "eval")
    assert jac.leaking_positions == list(range(T - 1)) and jac.jump_positions, chosen.table()
    assert set(jac.jump_positions) <= set(range(T // 2)), jac.jump_positions  # the path resamples the second half
    summary = chosen.summary()
    assert "jumped on a straight path to another future: a discrete change besides it" in summary, summary
    assert 'moe.MoELayer(d_model, d_ff, num_experts, router="ec_threshold")' in summary, summary


def test_moved_without_gradient_reads_each_mode_against_its_own_jacobian():
    def probe(name: str, mode: str, moved: list[int], probed: list[int] = ()) -> ProbeResult:
        return ProbeResult(
            name,
            mode,
            bool(moved),
            1.0,
            None,
            0.0,
            compares_forwards=name != "jacobian",
            leaking_positions=moved,
            probed_positions=list(probed),
            comparisons=1,
        )

    probes = [
        probe("jacobian", "train", [1, 4], probed=[0, 1, 2, 3, 4, 5]),
        probe("random_future", "train", [1, 3, 4, 9]),  # 3: probed, no gradient; 9: never probed
        probe("jacobian", "eval", [], probed=[0, 1, 2, 3, 4, 5]),
        probe("adversarial_future", "eval", [2]),
        probe("random_future", "eval", []),
    ]
    assert moved_without_gradient(probes) == [2, 3]
    assert moved_without_gradient(probes[:2]) == [3]
    assert moved_without_gradient(probes[1:2] + probes[3:4]) == []  # no Jacobian read in train
    probes[2].jump_positions = [7]
    assert moved_without_gradient(probes) == [2, 3, 7]


def _raises(x: Tensor) -> Tensor:
    raise RuntimeError("kaboom")


def _integer_output(x: Tensor) -> Tensor:
    return (x[..., :1] > 0).long().cumsum(dim=1)  # a prefix count: causal, integer


def test_a_raise_is_reported_with_its_file_and_line():
    line = inspect.getsourcelines(_raises)[1] + 1
    report = audit(_raises, example())
    assert report.error.endswith(f"RuntimeError: kaboom (raised at {__file__}:{line}))"), report.error


class _WrongWidth(nn.Module):
    """Its linear layer takes 8 features of the 16 it is given: torch raises inside nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class _ViewUnderDeviceMode(nn.Module):
    """A bad view inside ``with torch.device(...)`` (scattermoe's ParallelLinear runs its ops so):
    the innermost frame is torch's mode wrapper."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.device(x.device):
            return x.view(3, -1, 7)


@pytest.mark.parametrize("target, line", [(_WrongWidth, "return self.proj(x)"), (_ViewUnderDeviceMode, "x.view(3")])
def test_a_raise_inside_torch_names_the_targets_own_line(target, line):
    """torch's own frames are not where the target failed: the site is the target's line that called into
    torch (before: torch/nn/modules/linear.py or torch/utils/_device.py, the same for every target)."""
    lines, first = inspect.getsourcelines(target.forward)
    where = first + next(i for i, text in enumerate(lines) if line in text)
    report = audit(target(), example(), trials=1)
    assert report.error.endswith(f"(raised at {__file__}:{where}))"), report.error


def _raises_with_a_tensor(x: Tensor) -> Tensor:
    raise ValueError(f"found invalid values:\n{torch.full((32, 8), float('nan'))}")


def test_a_target_error_is_one_line_on_stderr(capsys, tmp_path):
    """A target's error text that prints a tensor (torch.distributions' argument check does)
    stays one line, cut to ERROR_CHARS of the error's own text (fastmoe's NoisyGate in eval gave
    35 lines)."""
    report = audit(_raises_with_a_tensor, example())
    assert "\n" not in report.error and report.error.count("nan") > 3, report.error
    own = report.modes_not_audited["train"].split("ValueError: ", 1)[1].rsplit(" (raised at ", 1)[0]
    assert own.startswith("found invalid values: tensor([[nan, nan,") and own.endswith("…"), own
    assert len(own) == runner.ERROR_CHARS, len(own)
    (tmp_path / "t.py").write_text(
        "import torch\n"
        "class Block(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError(f'found invalid values:\\n{torch.full((32, 8), float(\"nan\"))}')\n"
        "def f():\n"
        "    return Block()\n"
    )
    assert cli.main(["--target", f"{tmp_path / 't.py'}:f", "--input", "float:2,8,4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("moe-audit: error: f: NOT AUDITED: the target failed"), err


@torch.jit.script
def _top4(x: Tensor) -> Tensor:
    return torch.topk(x, k=4, dim=1)[1]


def _top4_of_the_prefix(x: Tensor) -> Tensor:
    """Causal; a prefix shorter than 4 fails inside TorchScript (XMoE's _top_idx at length 1)."""
    return x + _top4(x.cumsum(1)).sum().to(x.dtype) * 0


def test_a_torchscript_error_is_one_line_that_leads_with_the_error_it_reports():
    report = audit(_top4_of_the_prefix, example(), modes=("eval",))
    decode = report.probe("decode_consistency", "eval")
    assert decode.errors and all("\n" not in e for e in decode.errors), decode.errors
    assert (
        "RuntimeError: RuntimeError: selected index k out of range; The following operation failed"
        in (decode.errors[0])
    ), decode.errors[0]
    assert runner.one_line("one line: RuntimeError: x") == "one line: RuntimeError: x"  # one line stays as it is


def test_an_integer_output_says_which_probe_it_skips_and_why():
    report = audit(_integer_output, example(), modes=("eval",))
    assert report.error is None and report.leaks_in == [], report.summary()
    jac = report.probe("jacobian", "eval")
    assert not jac.ran and jac.skipped == "the output is integer or bool: it has no gradient to read"
    assert "jacobian/eval did not run: the output is integer or bool" in report.summary()
    assert "jacobian/eval did not run: the output is integer or bool" in report.table()


TARGETS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaboom")


    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)


    broken, causal = Broken(), Causal()
    """
)


def test_not_audited_is_one_line_on_stderr_even_verbose(tmp_path, capsys):
    (tmp_path / "t.py").write_text(TARGETS)
    argv = ["--target", f"{tmp_path / 't.py'}:broken", "--input", "float:4,16,8", "--no-progress", "--verbose"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # no table, no "batch-invariant: yes" over an audit that did not run
    assert captured.err.count("NOT AUDITED") == 1 and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("moe-audit: error: broken: NOT AUDITED: the target failed on the example")


def test_progress_lines_per_probe_on_stderr_not_in_json(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.py").write_text(TARGETS)
    monkeypatch.setattr(cli, "LONG_AUDIT_S", 0.0)  # every audit counts as long
    out_json = tmp_path / "a.json"
    argv = ["--target", f"{tmp_path / 't.py'}:causal", "--input", "float:4,16,8", "--json", str(out_json)]
    assert cli.main([*argv, "--modes", "eval", "--trials", "1"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    probes = ("random_future", "adversarial_future", "jacobian", "batch_interference", "decode_consistency")
    assert len(lines) == len(probes), captured.err
    assert all(line.startswith("moe-audit: causal: ") and " (eval): nothing found in " in line for line in lines)
    assert {line.split(": ")[2].split(" ")[0] for line in lines} == set(probes), captured.err
    assert "so far" not in out_json.read_text() and "so far" not in captured.out
    assert json.loads(out_json.read_text())["targets"][0]["leaks"] is False
    monkeypatch.setattr(cli, "LONG_AUDIT_S", 1e9)
    assert cli.main([*argv, "--modes", "eval", "--trials", "1"]) == 0
    assert capsys.readouterr().err == "", "a quick audit prints no progress"


# -- what the report says (issue 40, item 7) -------------------------------------------------
class LengthScaled(nn.Module):
    """y = x * T / 16: reads no later position, but a prefix of another length scales differently."""

    def forward(self, x_BTD: Tensor) -> Tensor:
        return x_BTD * (x_BTD.shape[1] / T)


def test_the_decode_line_names_capacity_only_where_the_mechanism_is_capacity():
    roll = audit(RollInTime(), example(), modes=("eval",)).summary()
    line = next(s for s in roll.splitlines() if "decode-consistent:" in s)
    assert "the leak above changes what a prefix sees" in line and "capacity" not in line, line
    sized = audit(_router("capacity", priority="position"), example(d=32), modes=("eval",)).summary()
    line = next(s for s in sized.splitlines() if "decode-consistent:" in s)
    assert "not a leak by itself: the capacity of CapacityRouter is sized from the sequence length T" in line, line
    scaled = audit(LengthScaled(), example(), modes=("eval",)).summary()
    line = next(s for s in scaled.splitlines() if "decode-consistent:" in s)
    assert "depend on the length T, not on what later positions hold" in line and "capacity" not in line, line


def test_the_built_in_table_says_a_claim_of_eval_mode_holds_in_eval():
    """ec_predictor claims decode consistency where it claims causality: in eval. Its training
    forward (expert choice) decodes differently; the table says the claim holds in eval."""
    from moe.audit import summary_table

    report = audit(_router("ec_predictor"), example(d=32), name="router ec_predictor")
    assert report.decode_differs_in == ["train"] and report.claims_hold, report.table()
    row = summary_table([report]).splitlines()[2].split()
    assert row[2:6] == ["eval", "only", "train", "yes/yes"] and row[6:9] == ["yes/same", "(eval)", "claims"], row


def test_the_jacobian_counts_a_leak_only_above_its_tolerance_in_the_json():
    for target in (RollInTime(), nn.Linear(D, D)):
        data = json.loads(audit(target, example(), modes=("eval",)).to_json())["targets"][0]
        jac = next(p for p in data["probes"] if p["name"] == "jacobian")
        assert jac["leaks"] == (jac["excess"] > 1), jac
        assert jac["leaks"] == isinstance(target, RollInTime), jac


def test_same_seed_outputs_that_depend_on_the_batch_size_are_not_called_deterministic():
    report = audit(NoiseOfTheBatch(), example(), modes=("eval",))
    torch.manual_seed(0)
    alone = NoiseOfTheBatch()(example()[:1])
    torch.manual_seed(0)
    in_batch = NoiseOfTheBatch()(example())[:1]
    assert not torch.equal(alone, in_batch), "the noise of a sample depends on the batch size"
    assert report.regimes == {"eval": "seeded"} and not report.leaks and report.batch_invariant, report.table()
    assert report.probe("batch_interference", "eval").p_value is not None, report.table()
    assert "seeded regime" in report.summary() and "deterministic" not in report.summary(), report.summary()


class HalfPrecisionExperts(nn.Module):
    """Runs its experts in bfloat16 and returns their output as it is: a float32 input comes back bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D).to(torch.bfloat16)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.lin(x_BTD.to(torch.bfloat16))


def test_a_float32_input_that_comes_back_bfloat16_gets_a_word():
    report = audit(HalfPrecisionExperts(), example(), modes=("eval",))
    assert report.notes == [
        "output comes back bfloat16 for a float32 input: a change below 3.1e-02 of an entry's scale (the "
        "tolerance of bfloat16) cannot be seen in it"
    ], report.notes
    assert report.notes[0] in report.summary()
    same = audit(nn.Linear(D, D), example(), modes=("eval",))
    assert same.notes == [], same.notes


def test_expert_choice_says_what_to_do_instead_of_decoding():
    with pytest.raises(ValueError, match=r"train with ec_threshold .* or ec_predictor; .* without the cache"):
        _router("expert_choice").init_decode_state(2)
