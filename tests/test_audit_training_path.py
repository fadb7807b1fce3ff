"""Train mode is audited as a training step runs: ``module.train()`` with gradients enabled.

The target is a BASE-layer-style MoE block written here from the description of BASE layers
(Lewis et al. 2021, "BASE Layers"; in fairseq, ``fairseq/modules/base_layer.py`` with the C++
auction in ``fairseq/clib/libbase/balanced_assignment.cpp``, commit 52a7fa5 on GitHub): in training,
a balanced assignment over every token of the batch gives each expert exactly N / E tokens; at
inference each token takes its best expert. The layer tells training from inference by
``torch.is_grad_enabled()`` (as tutel does for one of its paths) or by ``x.requires_grad`` (as
fairseq's does), not by ``module.training``; its assignment is an auction that, like fairseq's,
never ends when E does not divide N (some token can never hold a slot).

Shapes: B=4, T=16, D=16; E=4 experts for the leak (every prefix's 4 * t tokens divide by 4),
E=8 for the hang (odd prefixes give 4 * t tokens that 8 does not divide).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import SUBPROCESS_ENV
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import Tensor, nn

from moe.audit import audit

B, T, D = 4, 16, 16
BID_STEP = 0.02
"""The auction's least raise of a price (its epsilon), as a fraction of the scores' range."""


def balanced_auction(scores_NE: Tensor) -> Tensor:
    """int64 [N]: the expert of each token such that every expert holds exactly N // E tokens,
    by bidding: a token without a slot bids for its most valuable expert (score minus price) the
    margin over its second best plus BID_STEP of the scores' range; a full expert drops its lowest bid; an expert's
    price is its lowest held bid once full. Loops until every token holds a slot, so it never
    returns when E does not divide N. A pure-Python loop (so a signal can interrupt it)."""
    n, e = scores_NE.shape
    per = n // e
    scores = scores_NE.tolist()
    step = max(BID_STEP * float(scores_NE.max() - scores_NE.min()), 1e-4)
    held: list[dict[int, float]] = [{} for _ in range(e)]  # expert -> {token: its bid}
    owner = [-1] * n
    waiting = list(range(n))
    while waiting:
        tok = waiting.pop()
        price = [min(h.values()) if len(h) >= per else 0.0 for h in held]
        value = [scores[tok][x] - price[x] for x in range(e)]
        first = max(range(e), key=value.__getitem__)
        second = max((value[x] for x in range(e) if x != first), default=value[first])
        held[first][tok] = price[first] + value[first] - second + step
        owner[tok] = first
        if len(held[first]) > per:
            out = min(held[first], key=held[first].__getitem__)
            del held[first][out]
            owner[out] = -1
            waiting.append(out)
    return torch.tensor(owner)


class BalancedBlock(nn.Module):
    """x + w * expert(x) per token, the expert from the balanced auction in training (chosen by
    ``by``: "grad" for torch.is_grad_enabled(), "requires_grad" for x.requires_grad), the best
    expert otherwise; w = sigmoid(token . centroid of its expert), as BASE layers weigh it."""

    def __init__(self, experts: int = 4, by: str = "grad") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.centroids = nn.Parameter(torch.randn(experts, D, generator=gen))
        self.experts = nn.Parameter(torch.randn(experts, D, D, generator=gen) / math.sqrt(D))
        self.by = by

    def training_path(self, x: Tensor) -> bool:
        return torch.is_grad_enabled() if self.by == "grad" else x.requires_grad

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(-1, d)
        balanced = self.training_path(x_BTD)
        with torch.no_grad():
            scores_NE = x_ND @ self.centroids.T
            expert_N = balanced_auction(scores_NE) if balanced else scores_NE.argmax(-1)
        w_N1 = torch.sigmoid((x_ND * self.centroids[expert_N]).sum(-1, keepdim=True))
        y_ND = x_ND + w_N1 * torch.einsum("nd,nde->ne", x_ND, self.experts[expert_N])
        return y_ND.reshape(b, t, d)


def example(seed: int = 0) -> Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_the_auction_balances_on_a_hand_case():
    """Two experts, four tokens: both want expert 0; the two with the largest margin get it."""
    scores = torch.tensor([[3.0, 0.0], [2.0, 1.9], [2.5, 0.0], [1.0, 0.9]])
    assert balanced_auction(scores).tolist() == [0, 1, 0, 1]


def _future_moves_the_past(block: BalancedBlock, grad: bool) -> float:
    """The reference: the largest change at positions <= 7 when positions > 7 are resampled,
    called directly the way a training step (grad=True) or inference (grad=False) calls it."""
    x = example()
    y = x.clone()
    y[:, 8:] = torch.randn(B, T - 8, D, generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        a, b = (block(v.clone().requires_grad_(grad)) for v in (x, y))
    return float((a - b)[:, :8].abs().max().detach())


@pytest.mark.parametrize("by", ["grad", "requires_grad"])
def test_a_training_path_chosen_by_autograd_is_audited_in_train_mode(by):
    block = BalancedBlock(by=by)
    assert _future_moves_the_past(block, grad=True) > 0.1, "the balanced assignment must read the future"
    assert _future_moves_the_past(block, grad=False) == 0.0, "the greedy path is causal"
    report = audit(block, example(), name=f"balanced ({by})")
    assert report.leaks_in == ["train"], report.summary()
    assert not report.batch_invariant, report.summary()  # the auction spans the whole batch
    # In eval mode the Jacobian would run the training path (gradients on): it says so and does not run.
    jac = report.probe("jacobian", "eval")
    assert not jac.ran and "torch.is_grad_enabled()" in jac.skipped, report.table()
    assert "jacobian/eval did not run: with gradients enabled" in report.summary()


NEVER_RETURNS = textwrap.dedent(
    """
    import sys

    sys.path.insert(0, {tests!r})
    from test_audit_training_path import BalancedBlock

    layer = BalancedBlock(experts=8)
    """
)


def test_a_forward_that_never_returns_is_not_audited(tmp_path):
    """Every full batch divides by 8 experts; 4 x 3 tokens (the prefix 0..2) do not: the auction
    spins (the prefix of length 1 has no slot at all and raises). The audit stops at the first
    forward past the limit: NOT AUDITED, exit 2, one line."""
    x = example()
    start = time.perf_counter()
    report = audit(BalancedBlock(experts=8), x, modes=("train",), trials=1, forward_timeout=1.0)
    assert time.perf_counter() - start < 60
    assert report.verdict == "NOT AUDITED", report.summary()
    assert report.error.startswith("a forward on an input of shape (4, 3, 16) did not return within 1 s in train mode")
    assert "--forward-timeout" in report.error
    target = tmp_path / "never_returns.py"
    target.write_text(NEVER_RETURNS.format(tests=str(Path(__file__).resolve().parent)))
    argv = [sys.executable, "-m", "moe.audit", "--target", f"{target}:layer", "--input", "float:4,16,16"]
    done = subprocess.run(
        [*argv, "--forward-timeout", "1", "--modes", "train", "--trials", "1", "--no-progress", "--threads", "1"],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", done.stdout
    line = "moe-audit: error: layer: NOT AUDITED: a forward on an input of shape (4, 3, 16) did not return within 1 s"
    assert done.stderr.startswith(line) and done.stderr.count("NOT AUDITED") == 1, done.stderr
