"""BlockedAdamW's block-by-block path with the AdamW options that path passes on to torch's
own update (``maximize``, ``eps``): the same weights, states and state dict as torch's
for-loop AdamW given them, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_optim import assert_same, run

from moe.training.optim import BlockedAdamW


@pytest.mark.parametrize("options", [{"maximize": True}, {"eps": 1e-3}])
def test_blocked_path_options_are_torchs(options):
    assert_same(run(BlockedAdamW, **options), run(torch.optim.AdamW, **options))
