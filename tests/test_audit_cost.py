"""What the audit costs, as a user meets it. On 7dc4c10 the first target of a process paid about
a second of CPU importing torch._dynamo (a dispatch mode's warm-up) whether or not the target drew
random numbers; only a target that draws needs its draws recorded.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import SUBPROCESS_ENV

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
