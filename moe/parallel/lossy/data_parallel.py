"""Data-parallel training over a lossy transport: gradient aggregation reduce-scatter style,
an owner-side optimizer step, a bounded-drift parameter broadcast, and the drift measured.

Shape legend: P ranks, n elements of the flat parameter (and gradient) vector, S elements of
this rank's shard (``shard_bounds``: contiguous, rank j owns shard j).

One step (:meth:`LossyDataParallel.step`, after ``loss.backward()`` on every rank):

1. **reduce-scatter**: rank i sends shard j of its gradient g_i to its owner j, packet by
   packet (:meth:`LossyTransport.reduce_scatter_sum`); the owner combines what arrived by
   ``policy`` (below) into its estimate of the mean gradient of shard j;
2. the owner updates shard j (the optimizer runs on the whole replica, only the owned shard
   of the result is kept: ZeRO-1's update with redundant arithmetic, and the optimizer state of
   an element is only ever driven by its owner's gradients);
3. **broadcast** (all-gather): each owner sends its updated shard; a rank that loses a packet
   keeps its stale values for it (:meth:`LossyTransport.all_gather_stale`); every
   ``resync_every`` steps the broadcast is reliable and every replica equals the owners';
4. **drift**: the spread (max minus min over ranks) of every element of the replicas, summarised
   per parameter as max and RMS (one reliable all-reduce: a measurement, not training traffic).

The global gradient norm for clipping and the router statistics are small control messages
sent reliably.

**Policies.** For one packet of shard j let m_i in {0, 1} say whether rank i's packet arrived
(m_j = 1: the owner's own never travels) and M = sum_i m_i.

* ``reliable``: sum_i g_i / P by the ordinary all-reduce (today's :func:`reduce_gradients`),
  and a reliable broadcast: the transport is bypassed.
* ``unbiased``: sum_i m_i g_i / M, the average of what arrived. The weights m_i / M sum to 1 for
  every loss pattern and do not depend on the data. Each rank's batch is an independent draw,
  so every g_i has the same expectation, the true gradient G; hence E[estimate | m] = G for
  every pattern and E[estimate] = G whatever p (and for bursts too). It is not unbiased for the
  mean of the P gradients of this particular step: given them, it weighs the owner's gradient
  by E[1/M] = (1 - p^P) / (P (1 - p)) >= 1/P and each other rank's correspondingly less. That
  extra weight is sampling noise (the owner's batch is as good a sample of G as any), not bias.
* ``naive``: sum_i m_i g_i / P, lost packets counted as zeros. E = (g_j + (1 - p) sum_{i != j} g_i) / P:
  the other ranks' parts shrink by (1 - p), so the step is biased toward 0 by the factor
  1 - p (P - 1) / P when the ranks' gradients agree.
* ``reweighted``: (g_j + sum_{i != j} m_i g_i / (1 - p)) / P (inverse-probability, Horvitz-Thompson
  weights; p is the marginal loss rate). Its expectation given this step's gradients is their
  mean exactly, at the price of more variance (arrived packets amplified by 1 / (1 - p)).

**Why the drift is bounded.** Take an element of shard j and a rank r != j. After step t the
owner holds x_t; rank r holds x_s, the value of the last step s <= t whose broadcast packet
reached it (or the last resync). The difference x_t - x_s is the sum of the updates of the
last G = t - s steps. Each step's packet is lost independently of the previous steps' (the
step is in the hash), so P(G >= g) = p^g: G is geometric with mean p / (1 - p) (0.11 steps
at p = 0.1), whatever t is. The updates are bounded (AdamW moves an element by at most about
lr per step, plus weight decay), so |drift| <= G * max update: bounded in distribution, not
growing with the number of steps, unlike a replica that stops receiving, whose gap grows with
t. A resync every K steps caps G at K - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.parallel.exchange import group_rank_size, guarded
from moe.parallel.lossy.transport import LossConfig, LossyTransport, shard_bounds
from moe.parallel.state import _flat_grads, expert_parallel_layers

POLICIES = ("reliable", "unbiased", "naive", "reweighted")


@dataclass
class LossyDPConfig:
    """Lossy data-parallel training. Validated on construction."""

    policy: str = "unbiased"
    """Gradient aggregation: reliable, unbiased, naive or reweighted (see the module docstring)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Packet size and loss model of both the gradient reduce-scatter and the parameter broadcast."""
    resync_every: int = 0
    """Every K-th step (step % K == 0) the parameter broadcast is reliable; 0 = never."""
    grad_clip: float = 1.0
    """Clip the norm of the aggregated gradient to this (0 = no clipping)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.resync_every, int) or self.resync_every < 0:
            raise ValueError(f"resync_every must be an integer >= 0, got {self.resync_every!r}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip}")


def aggregate_gradient(flat_n: Tensor, policy: str, transport: LossyTransport) -> Tensor:
    """[S]: this rank's shard of the estimate of the mean over ranks of ``flat_n`` (every
    rank's flat gradient), combined by ``policy``. A collective over ``transport.group``."""
    rank, size = group_rank_size(transport.group)
    if policy == "reliable":
        buf = flat_n.clone()
        guarded("gradient all-reduce", transport.group, lambda: dist.all_reduce(buf, group=transport.group))
        lo, hi = shard_bounds(flat_n.numel(), size)[rank]
        return buf[lo:hi] / size
    if policy == "unbiased":
        total_S, arrivals_S = transport.reduce_scatter_sum(flat_n)
        return total_S / arrivals_S
    if policy == "naive":
        return transport.reduce_scatter_sum(flat_n)[0] / size
    if policy == "reweighted":
        return transport.reduce_scatter_sum(flat_n, 1.0 / (1.0 - transport.cfg.rate))[0] / size
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def replica_spread(flat_n: Tensor, group=None) -> Tensor:
    """[n]: max minus min over the ranks of ``group`` of each element (one reliable all-reduce
    MAX of the values and their negatives)."""
    both_2n = torch.cat([flat_n, -flat_n])
    guarded("drift all-reduce", group, lambda: dist.all_reduce(both_2n, op=dist.ReduceOp.MAX, group=group))
    n = flat_n.numel()
    return both_2n[:n] + both_2n[n:]


class LossyDataParallel:
    """Drives one data-parallel replica of ``model`` through lossy steps (module docstring).
    Every parameter is replicated (no expert-parallel layers); ``optimizer`` holds all of
    ``model``'s trainable parameters; every rank of ``group`` calls :meth:`step` each step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: LossyDPConfig, group=None):
        if expert_parallel_layers(model):
            raise ValueError("LossyDataParallel replicates every parameter: build the model without expert parallelism")
        self.model, self.optimizer, self.cfg, self.group = model, optimizer, cfg, group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.transport = LossyTransport(cfg.loss, group)
        self.rank, self.size = group_rank_size(group)
        n = sum(p.numel() for p in self.params)
        self.lo, self.hi = shard_bounds(n, self.size)[self.rank]

    def _flat_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write_params(self, flat_n: Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(flat_n[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _sum(self, values: list[float]) -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64, device=self.params[0].device)
        guarded("control all-reduce", self.group, lambda: dist.all_reduce(buf, group=self.group))
        return buf.tolist()

    @torch.no_grad()
    def step(self, step: int) -> dict:
        """Aggregate the gradients, update the owned shard, broadcast, measure. Returns (the
        same on every rank): ``grad_rel_error`` ||est - mean|| / ||mean|| and ``grad_bias``
        <est - mean, mean> / ||mean||^2 of the aggregated gradient against the reliable mean of
        the same local gradients, ``received_fraction`` (gradient and broadcast packets over the
        network that arrived, all ranks), ``max_drift``, ``rms_drift`` (over every element) and
        ``drift`` (parameter name -> (max, rms)), ``grad_norm`` (before clipping), ``resync``."""
        self.transport.begin_step(step)
        flat_n = _flat_grads(self.params)
        est_S = aggregate_gradient(flat_n, self.cfg.policy, self.transport)
        mean_n = flat_n.clone()
        guarded("reference all-reduce", self.group, lambda: dist.all_reduce(mean_n, group=self.group))
        mean_S = mean_n[self.lo : self.hi] / self.size
        err_S = (est_S - mean_S).double()
        sq_err, sq_mean, dot, sq_est = self._sum([
            float(err_S.square().sum()), float(mean_S.double().square().sum()),
            float((err_S * mean_S.double()).sum()), float(est_S.double().square().sum()),
        ])
        grad_norm = math.sqrt(sq_est)
        coef = min(1.0, self.cfg.grad_clip / (grad_norm + 1e-6)) if self.cfg.grad_clip > 0 else 1.0
        grad_n = torch.zeros_like(flat_n)
        grad_n[self.lo : self.hi] = est_S * coef if coef < 1.0 else est_S
        offset = 0
        for p in self.params:
            p.grad = grad_n[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        stale_n = self._flat_params()
        self.optimizer.step()
        shard_S = self._flat_params()[self.lo : self.hi]
        resync = self.cfg.policy == "reliable" or (self.cfg.resync_every > 0 and step % self.cfg.resync_every == 0)
        new_n = self.transport.all_gather_stale(shard_S, stale_n, reliable=resync)
        self._write_params(new_n)
        received, expected = self._sum([float(self.transport.received), float(self.transport.expected)])
        spread_n = replica_spread(new_n, self.group).double()
        drift, offset = {}, 0
        for name, p in zip(self.names, self.params):
            part = spread_n[offset : offset + p.numel()]
            drift[name] = (float(part.max()), float(part.square().mean().sqrt()))
            offset += p.numel()
        return {
            "grad_rel_error": math.sqrt(sq_err / max(sq_mean, 1e-300)),
            "grad_bias": dot / max(sq_mean, 1e-300),
            "received_fraction": received / expected if expected else 1.0,
            "max_drift": float(spread_n.max()),
            "rms_drift": float(spread_n.square().mean().sqrt()),
            "drift": drift,
            "grad_norm": grad_norm,
            "resync": resync,
        }
