"""The ``unbiased`` lossy aggregation divides each element's sum by the number of contributions
that arrived for it (the owner's own always among them), element by element: the average of what
arrived. In one process (``Workers.in_process``, the simulator's path; tests/test_lossy.py checks
the gloo path against a reference built from the loss masks), P = 4 workers at p = 0.5, one
element per packet, so elements of one shard see different numbers of arrivals:

* equal gradients on every worker come back exactly, whatever arrived (the weights sum to 1);
* the number M of arrivals and the sum S of what arrived are read off the ``naive`` policy
  (sum / P, lost counted as 0) on the same loss pattern, with gradients 1 and 2^i on worker i
  (a sum of distinct powers of two names the workers that arrived); ``unbiased`` must be S / M.
"""

from __future__ import annotations

import torch

from moe.parallel.lossy import LossConfig, LossyTransport, Workers, aggregate_gradient

P, N = 4, 24
CFG = LossConfig(rate=0.5, packet_size=1, seed=7)


def aggregate(grads_Pn: torch.Tensor, policy: str, step: int) -> torch.Tensor:
    """The full aggregated vector (every worker's shard, concatenated) of one step."""
    transport = LossyTransport(CFG)
    transport.begin_step(step)
    return torch.cat(aggregate_gradient(grads_Pn, policy, transport, Workers.in_process(P)))


def test_unbiased_divides_each_elements_sum_by_its_arrivals():
    ones_Pn = torch.ones(P, N, dtype=torch.float64)
    powers_Pn = (2.0 ** torch.arange(P, dtype=torch.float64))[:, None].expand(P, N).contiguous()
    g_n = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    seen = set()
    for step in range(3):
        same = aggregate(g_n.expand(P, N).contiguous(), "unbiased", step)
        assert torch.equal(same, g_n), f"step {step}: max |diff| {float((same - g_n).abs().max()):.3g}"
        arrived_n = P * aggregate(ones_Pn, "naive", step)  # M: how many of the P contributions arrived
        sum_n = P * aggregate(powers_Pn, "naive", step)  # S: the sum of 2^i over the workers that arrived
        bits_n = sum_n.long()
        popcount_n = sum(((bits_n >> i) & 1) for i in range(P))
        assert torch.equal(popcount_n.double(), arrived_n)  # the two readings of the pattern agree
        got = aggregate(powers_Pn, "unbiased", step)
        assert torch.allclose(got, sum_n / arrived_n, rtol=1e-15, atol=0), (step, got, sum_n / arrived_n)
        seen |= set(arrived_n.long().tolist())
    assert {1, P} < seen, f"arrival counts seen: {sorted(seen)}: the case must mix losses with none"
