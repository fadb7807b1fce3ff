"""What the audit costs, as a user meets it. On 7dc4c10 the first target of a process paid about
a second of CPU importing torch._dynamo (a dispatch mode's warm-up) whether or not the target drew
random numbers; only a target that draws needs its draws recorded.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from helpers import SUBPROCESS_ENV
from test_audit import _one_thread  # noqa: F401  (one torch thread: the audit's clock is then CPU time)
from torch import Tensor, nn

from moe.audit import audit

FIRST_AUDIT = """
import sys, torch
from moe import MoELayer
from moe.audit import audit
torch.manual_seed(0)
layer = MoELayer(32, 64, 4, router="topk", top_k=2)
report = audit(layer, torch.randn(4, 16, 32))
print(report.regime, "torch._dynamo" in sys.modules)
"""


def test_a_target_that_draws_nothing_never_loads_the_draw_recorder():
    """(A target that draws is recorded as before: the seeded-regime tests of test_audit.py.)"""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_AUDIT], env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deterministic False", done.stdout


class BusyBlock(nn.Module):
    """A position-wise block whose forward burns 2 ms of CPU: a forward of known cost."""

    def forward(self, x: Tensor) -> Tensor:
        start = time.process_time()
        while time.process_time() - start < 0.002:
            pass
        return torch.tanh(x)


def test_the_unit_of_the_cost_is_the_median_of_plain_forwards_on_cpu_time():
    """On 7dc4c10 the unit was one timed forward (on a loaded machine, wall time at random)."""
    report = audit(BusyBlock(), torch.randn(4, 16, 8), modes=("eval",))
    assert report.cost_clock == "cpu" and report.unit_forwards == 7, report.to_dict()
    assert 0.002 <= report.forward_seconds < 0.004, report.forward_seconds
    assert report.forward_equivalents == pytest.approx(report.cost_seconds / report.forward_seconds)
    # Every call of the target costs at least one forward: the figure is never below the calls.
    assert report.forward_equivalents >= report.forwards * 0.9, (report.forward_equivalents, report.forwards)
    line = report.summary().splitlines()[-1]
    assert "forward-equivalents (the audit's CPU time over one eval forward of the example, " in line, line
    assert "the median of 7)" in line, line
