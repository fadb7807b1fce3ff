"""Batch invariance and decode consistency the audit could not test are "not tested" (None),
never a vacuous yes: llm-random's random-group Mixture of Tokens rejects every prefix length,
and its sequence-group form every length not a multiple of its group (moe.audit.report)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.audit import CausalityError, assert_causal, audit
from moe.audit.report import summary_table


class Fixed(nn.Module):
    """A causal per-position map that runs only at its example's batch size and length."""

    def __init__(self, b: int, t: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b, self.t, self.lin = b, t, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[0] == self.b or self.b == 0, f"batch of {self.b} only"
        assert x.shape[1] == self.t or self.t == 0, f"length {self.t} only"
        return self.lin(x)


class BlockMix(nn.Module):
    """Each position plus a softmax-weighted mean of its block of ``g`` positions (a leak inside
    the block); lengths that are not a multiple of ``g`` are refused."""

    def __init__(self, g: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.w = g, nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        xg = x.view(b, -1, self.g, d)
        a = torch.softmax(xg @ self.w, dim=-1).unsqueeze(-1)
        return (xg + (a * xg).sum(-2, keepdim=True)).view(b, t, d)


class FixedLengthMix(nn.Module):
    """lucidrains' non-causal gMLP gate: every position mixed by a [T, T] weight of the example's
    length. Other lengths fail the einsum, but one position broadcasts against the weight and
    returns [B, T, D] from a [B, 1, D] input."""

    def __init__(self, t: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(t, t) / t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.einsum("bnd,mn->bmd", x, self.w)


def test_a_prefix_output_of_another_length_is_no_decode_comparison():
    """The one-position prefix's [2, 16, 16] output has B * T = 2 rows, so it was read as a flat
    [B * T, ...] output holding [16, 16] per position and compared: "decode-consistent: yes;
    prefix lengths 2-15 could not run". It is not per position: that forward fails too."""
    report = audit(FixedLengthMix(16), torch.randn(2, 16, 16), modes=("eval",), trials=1)
    assert report.leaks and report.decode_consistent is None, report.summary()
    decode = report.probe("decode_consistency", "eval")
    assert 1 in decode.skipped_lengths and decode.comparisons == 0, report.table()
    assert "its [B, T, ...] output held [16] per position before" in report.summary(), report.summary()
    # the target returned what cannot be read: no "raised at" a line of the audit's own code
    assert "moe/audit/" not in "\n".join(e for p in report.probes for e in p.errors), report.table()


class ChunkedCumsum(nn.Module):
    """A causal running mean computed chunk by chunk, as fla's naive chunked linear attention
    computes its state (chunks of 64, other lengths refused)."""

    def __init__(self, chunk: int) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        assert t % self.chunk == 0, f"length a multiple of {self.chunk} only"
        return x.cumsum(1) / torch.arange(1, t + 1)[:, None]


def test_a_chunked_target_is_decoded_at_a_length_no_cut_gives():
    """At T = 128 the 16 cuts give prefix lengths 1, 9, 18, ..., 127, none a multiple of 64: fla's
    chunked linear attention read "decode-consistent: not tested: no prefix-only forward ran"
    though its prefix of 64 runs and matches."""
    report = audit(ChunkedCumsum(64), torch.randn(2, 128, 4), modes=("eval",), trials=1)
    decode = report.probe("decode_consistency", "eval")
    assert report.decode_consistent is True and decode.comparisons == 1, report.summary()
    assert 127 in decode.skipped_lengths and 64 not in decode.skipped_lengths, decode.skipped_lengths


def test_no_prefix_that_runs_is_not_tested_and_fails_a_decode_assertion():
    x = torch.randn(2, 16, 16)
    report = audit(Fixed(0, 16), x, modes=("eval",))
    assert not report.leaks and report.batch_invariant is True
    assert report.decode_consistent is None
    assert "decode-consistent: not tested: no prefix-only forward ran (eval: input (2, 1, 16)" in report.summary()
    assert report.to_dict()["decode_consistent"] is None
    assert report.claims_hold  # nothing claimed, nothing shown false
    assert_causal(Fixed(0, 16), x, modes=("eval",))  # causal is all it asserts
    with pytest.raises(CausalityError, match="decode consistency not tested: no prefix-only forward ran"):
        assert_causal(Fixed(0, 16), x, modes=("eval",), decode_consistent=True)


def test_no_other_batch_that_runs_is_not_tested_and_fails_a_batch_assertion():
    x = torch.randn(1, 16, 16)
    report = audit(Fixed(1, 0), x, modes=("eval",))
    assert report.batch_invariant is None and report.decode_consistent is True
    assert "batch-invariant: not tested: no forward of another batch ran (eval: input (2, 16, 16)" in report.summary()
    assert "?/untested" in summary_table([report])
    with pytest.raises(CausalityError, match="batch invariance not tested"):
        assert_causal(Fixed(1, 0), x, modes=("eval",), batch_invariant=True)


def test_a_probe_untested_in_one_mode_only_says_so_beside_the_other_modes_finding():
    class EvalOnlyPrefixes(Fixed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert not self.training or x.shape[1] == 16, "training at length 16 only"
            return self.lin(x)

    report = audit(EvalOnlyPrefixes(0, 0), torch.randn(2, 16, 16))
    assert report.decode_consistent is True
    assert report.untested("decode") == ["train"]
    assert "decode-consistent: yes; not tested in train mode (input (2, 1, 16)" in report.summary()


def test_the_lengths_a_prefix_could_not_run_are_named_beside_a_yes():
    report = audit(BlockMix(4), torch.randn(2, 16, 16))
    assert report.leaks_in == ["train", "eval"]
    assert report.decode_consistent is True  # at 4, 8 and 12 a prefix is the full output's first blocks
    line = "decode-consistent: yes; prefix lengths 1-3, 5-7, 9-11, 13-15 could not run (train, eval)\n"
    assert line in report.summary(), report.summary()
