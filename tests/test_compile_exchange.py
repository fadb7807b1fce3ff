"""torch.compile of an expert-parallel MoELayer: the exchange runs eagerly between the compiled
graphs (its all-to-all needs split sizes on the host), one deliberate break instead of
Dynamo's reports at each host read, and the compiled layer equals the eager one. One process over gloo: the exchange's
code path is the same for any group size."""

from __future__ import annotations

import torch
from test_compile import assert_close, recording_backend, run
from torch._dynamo.utils import counters

import moe
from moe.parallel.exchange import ExpertParallel


def test_compiled_expert_parallel_layer_breaks_only_around_the_exchange_and_equals_eager(world_of_one):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 32, 4, router="topk", top_k=2, expert_parallel=ExpertParallel(world_of_one))
    x = torch.randn(2, 9, 16)
    graphs: list = []
    got = run(layer, x, torch.compile(layer, backend=recording_backend(graphs)))
    # the one deliberate break (once per compiled frame), not Dynamo's host-read reports
    # (Tensor.item(), bincount, repeat_interleave: ten of them without the disable)
    breaks = dict(counters["graph_break"])
    assert breaks and all("expert_parallel_ffn" in b and "split sizes are read on the host" in b for b in breaks), (
        breaks
    )
    assert sum(breaks.values()) <= 2 and len(graphs) <= 4, (breaks, len(graphs))
    assert_close(got, run(layer, x), "expert-parallel layer compiled vs eager")
