"""Data-parallel training over a lossy transport: gradient aggregation reduce-scatter style,
an owner-side optimizer step, a bounded-drift parameter broadcast, and the drift measured.

Shape legend: P workers (ranks), n elements of the flat parameter (and gradient) vector, S
elements of a worker's shard (``shard_bounds``: contiguous, worker j owns shard j).

One implementation of the step, :class:`LossyReplicas`, drives the replicas of a set of
:class:`~moe.parallel.lossy.transport.Workers`: :class:`LossyDataParallel` is one replica per
process (``torch.distributed``), :class:`~moe.parallel.lossy.simulated.SimulatedDataParallel`
every replica in one process. One step (:meth:`LossyReplicas.step`, after every replica's
``loss.backward()``):

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

**The error each policy should make** (``grad_rel_error_predicted``, beside the measured
``grad_rel_error``), in expectation over the loss pattern given this step's gradients. Write
q = 1 - p, d_i = g_i - mean for worker i's deviation, x^(j) for the part of a vector in shard j.
Every rank but the owner loses a packet with probability p, independently of the other ranks
(bursts only correlate the packets of one message), so for the owner j of a shard:

* naive: error = -sum_{r != j} (1 - m_r) g_r^(j) / P, whose mean square is
  (pq sum_{r != j} |g_r^(j)|^2 + p^2 |sum_{r != j} g_r^(j)|^2) / P^2;
* unbiased: error = -sum_{r in L} d_r^(j) / (P - k) (the deviations sum to 0), L the k other
  ranks whose packet was lost, k binomial(P - 1, p); a uniform k-subset of the m = P - 1 others
  has E|sum_L d_r|^2 = k/m S1 + k(k-1)/(m(m-1)) (S2 - S1), with S1 = sum_{r != j} |d_r^(j)|^2
  and S2 = |d_j^(j)|^2 = |sum_{r != j} d_r^(j)|^2; the expectation sums that over k (for many
  workers about (pq S1 + p^2 S2) / (1 + (P - 1) q)^2: taking P - k at its mean would miss the
  steps where more is lost and less divides it, 40% low at P = 8, p = 0.2);
* reweighted: (p / q) sum_{r != j} |g_r^(j)|^2 / P^2.

Summed over the shards and divided by |mean|^2. For many workers the unbiased figure tends to
sqrt(p / q * grad_noise_share), with ``grad_noise_share`` = sum_i |d_i|^2 / (P^2 |mean|^2):
averaging what arrived loses only the workers' noise, never the signal they share. Its
expectation is (P - 1) / P times the **noise share** Var(mean) / |mean|^2, the part of the mean
gradient's square norm that is sampling noise, which at a fixed number of sequences per step
is the same however they are split among workers (``experiments/packet_loss.py`` reports the
noise share, P / (P - 1) times the figure).

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
from torch import Tensor, nn

from moe.parallel.lossy.transport import LossConfig, LossyTransport, Workers, shard_bounds
from moe.parallel.state import _flat_grads, expert_parallel_layers

POLICIES = ("reliable", "unbiased", "naive", "reweighted")
METRICS = (
    "received_fraction",
    "grad_rel_error",
    "grad_rel_error_predicted",
    "grad_noise_share",
    "grad_bias",
    "max_drift",
    "rms_drift",
)
"""The per-step scalar figures of :meth:`LossyReplicas.step` that a training log keeps."""


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


def aggregate_gradient(flats_Ln: Tensor, policy: str, transport: LossyTransport, workers: Workers) -> list[Tensor]:
    """[S] per local worker: its shard of the estimate of the mean over the workers of their
    flat gradients (``flats_Ln``: the local workers', stacked), combined by ``policy``. A
    collective over ``workers``."""
    if policy == "reliable":
        total_n = workers.sum(flats_Ln)
        return [
            total_n[lo:hi] / workers.size
            for lo, hi in (shard_bounds(total_n.numel(), workers.size)[r] for r in workers.local)
        ]
    if policy == "unbiased":
        return [total_S / arrivals_S for total_S, arrivals_S in transport.reduce_scatter_sum(flats_Ln, workers)]
    if policy == "naive":
        return [total_S / workers.size for total_S, _ in transport.reduce_scatter_sum(flats_Ln, workers)]
    if policy == "reweighted":
        scale = 1.0 / (1.0 - transport.cfg.rate)
        return [total_S / workers.size for total_S, _ in transport.reduce_scatter_sum(flats_Ln, workers, scale)]
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def replica_spread(flats_Ln: Tensor, workers: Workers) -> Tensor:
    """[n]: max minus min over every worker's vector (``flats_Ln``: the local workers', stacked)
    of each element (one reliable maximum over the workers of the values and their negatives)."""
    both_2n = workers.max(torch.cat([flats_Ln, -flats_Ln], dim=1))
    n = flats_Ln.shape[1]
    return both_2n[:n] + both_2n[n:]


def _flat_params(params: list[nn.Parameter]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _write(params: list[nn.Parameter], flat_n: Tensor, grad: bool = False) -> None:
    """Copy consecutive slices of ``flat_n`` into the parameters (into fresh ``.grad`` tensors
    with ``grad``)."""
    offset = 0
    for p in params:
        part = flat_n[offset : offset + p.numel()].view_as(p)
        if grad:
            p.grad = part.to(p.dtype).clone()
        else:
            p.data.copy_(part)
        offset += p.numel()


class LossyReplicas:
    """Lossy data-parallel steps (module docstring) of the replicas of this process's workers:
    ``models[i]`` with ``optimizers[i]`` (holding all its trainable parameters) is the replica of
    worker ``workers.local[i]``. Every parameter is replicated (no expert-parallel layers)."""

    def __init__(
        self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], cfg: LossyDPConfig, workers: Workers
    ):
        if len(models) != len(workers.local) or len(optimizers) != len(models):
            raise ValueError(
                f"{len(models)} models and {len(optimizers)} optimizers for {len(workers.local)} local workers"
            )
        if any(expert_parallel_layers(m) for m in models):
            raise ValueError(
                "lossy data parallelism replicates every parameter: build the model without expert parallelism"
            )
        self.models, self.optimizers, self.cfg, self.workers = models, optimizers, cfg, workers
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in models]
        self.names = [name for name, p in models[0].named_parameters() if p.requires_grad]
        self.transport = LossyTransport(cfg.loss, workers.group)
        n = sum(p.numel() for p in self.params[0])
        self.bounds = [shard_bounds(n, workers.size)[r] for r in workers.local]

    def _sum(self, values: list[float]) -> list[float]:
        """Control figures (already summed over this process's workers) summed over the processes."""
        t = torch.tensor(values, dtype=torch.float64, device=self.params[0][0].device)
        return self.workers.across_processes(t).tolist()

    def _estimate(self) -> tuple[list[Tensor], dict]:
        """Each local owner's shard of the aggregated gradient, clipped, and its error figures
        against the reliable mean of the same gradients."""
        flats_Ln = torch.stack([_flat_grads(params) for params in self.params])
        ests_S = aggregate_gradient(flats_Ln, self.cfg.policy, self.transport, self.workers)
        mean_n = self.workers.sum(flats_Ln) / self.workers.size
        sums = [0.0] * 4
        for (lo, hi), est_S in zip(self.bounds, ests_S):
            mean_S = mean_n[lo:hi].double()
            err_S = est_S.double() - mean_S
            for i, v in enumerate(
                [err_S.square().sum(), mean_S.square().sum(), (err_S * mean_S).sum(), est_S.double().square().sum()]
            ):
                sums[i] += float(v)
        totals = self._sum(sums + self._spread_sums(flats_Ln, mean_n))
        (sq_err, sq_mean, dot, sq_est), spread = totals[:4], totals[4:]
        grad_norm = math.sqrt(sq_est)
        coef = min(1.0, self.cfg.grad_clip / (grad_norm + 1e-6)) if self.cfg.grad_clip > 0 else 1.0
        figures = {
            "grad_rel_error": math.sqrt(sq_err / max(sq_mean, 1e-300)),
            "grad_rel_error_predicted": math.sqrt(self._predicted_sq_error(*spread) / max(sq_mean, 1e-300)),
            "grad_noise_share": spread[0] / (self.workers.size**2 * max(sq_mean, 1e-300)),
            "grad_bias": dot / max(sq_mean, 1e-300),
            "grad_norm": grad_norm,
        }
        return [est_S * coef if coef < 1.0 else est_S for est_S in ests_S], figures

    def _spread_sums(self, flats_Ln: Tensor, mean_n: Tensor) -> list[float]:
        """This process's parts of the sums the predicted error needs (module docstring), over
        its workers i with own shard (lo, hi): |d_i|^2, |d_i^(i)|^2, |g_i|^2, |g_i^(i)|^2 and
        |P mean^(i) - g_i^(i)|^2."""
        sums = [0.0] * 5
        for flat_n, (lo, hi) in zip(flats_Ln.double(), self.bounds):
            dev_n = flat_n - mean_n.double()
            others_S = self.workers.size * mean_n[lo:hi].double() - flat_n[lo:hi]
            for i, part in enumerate((dev_n, dev_n[lo:hi], flat_n, flat_n[lo:hi], others_S)):
                sums[i] += float(part.square().sum())
        return sums

    def _predicted_sq_error(self, dev: float, dev_own: float, sq: float, sq_own: float, others: float) -> float:
        """The expected |estimate - mean|^2 of this step's policy over the loss pattern, given the
        gradients (the sums of :meth:`_spread_sums` over every worker; module docstring)."""
        p, n = self.transport.cfg.rate, self.workers.size
        q = 1.0 - p
        if self.cfg.policy == "unbiased":
            m = n - 1
            weights = [math.comb(m, k) * p**k * q ** (m - k) / (n - k) ** 2 for k in range(m + 1)]
            c1 = sum(w * k / m for k, w in enumerate(weights))
            c2 = sum(w * k * (k - 1) / (m * (m - 1)) for k, w in enumerate(weights)) if m > 1 else 0.0
            return c1 * (dev - dev_own) + c2 * (2 * dev_own - dev)
        if self.cfg.policy == "naive":
            return (p * q * (sq - sq_own) + p * p * others) / n**2
        if self.cfg.policy == "reweighted":
            return p / q * (sq - sq_own) / n**2
        return 0.0

    def _drift(self, news_Ln: Tensor) -> dict:
        spread_n = replica_spread(news_Ln, self.workers).double()
        drift, offset = {}, 0
        for name, p in zip(self.names, self.params[0]):
            part = spread_n[offset : offset + p.numel()]
            drift[name] = (float(part.max()), float(part.square().mean().sqrt()))
            offset += p.numel()
        return {"max_drift": float(spread_n.max()), "rms_drift": float(spread_n.square().mean().sqrt()), "drift": drift}

    @torch.no_grad()
    def step(self, step: int) -> dict:
        """Aggregate the gradients, update the owned shards, broadcast, measure. Returns (the
        same on every process): ``grad_rel_error`` ||est - mean|| / ||mean|| (and the policy's
        expected figure, ``grad_rel_error_predicted``, with ``grad_noise_share``), ``grad_bias``
        <est - mean, mean> / ||mean||^2 of the aggregated gradient against the reliable mean of
        the same local gradients, ``received_fraction`` (gradient and broadcast packets over the
        network that arrived, all workers), ``max_drift``, ``rms_drift`` (over every element) and
        ``drift`` (parameter name -> (max, rms)), ``grad_norm`` (before clipping), ``resync``."""
        self.transport.begin_step(step)
        ests_S, figures = self._estimate()
        stales_n, shards = [], []
        for params, optimizer, (lo, hi), est_S in zip(self.params, self.optimizers, self.bounds, ests_S):
            grad_n = torch.zeros(sum(p.numel() for p in params), dtype=est_S.dtype, device=est_S.device)
            grad_n[lo:hi] = est_S
            _write(params, grad_n, grad=True)
            stales_n.append(_flat_params(params))
            optimizer.step()
            shards.append(_flat_params(params)[lo:hi])
        resync = self.cfg.policy == "reliable" or (self.cfg.resync_every > 0 and step % self.cfg.resync_every == 0)
        news_Ln = self.transport.all_gather_stale(shards, torch.stack(stales_n), self.workers, reliable=resync)
        for params, new_n in zip(self.params, news_Ln):
            _write(params, new_n)
        received, expected = self._sum([float(self.transport.received), float(self.transport.expected)])
        return {
            **figures,
            "received_fraction": received / expected if expected else 1.0,
            **self._drift(news_Ln),
            "resync": resync,
        }


class LossyDataParallel(LossyReplicas):
    """Drives one data-parallel replica of ``model`` per process of ``group`` through lossy
    steps (module docstring). Every parameter is replicated (no expert-parallel layers);
    ``optimizer`` holds all of ``model``'s trainable parameters; every rank of ``group`` calls
    :meth:`step` each step, after its ``loss.backward()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: LossyDPConfig, group=None):
        super().__init__([model], [optimizer], cfg, Workers.from_group(group))
        self.model, self.optimizer, self.group = model, optimizer, group
