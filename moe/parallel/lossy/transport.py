"""A simulated lossy transport on top of ``torch.distributed``: messages cut into packets,
packets lost at random, the loss pattern a pure function of where and when a packet travels.

Shape legend: P ranks in the group, n elements in a message (a flat tensor), K packets of a
message (K = ceil(n / packet_size)).

**What is simulated, honestly.** torch.distributed has no unreliable transport: gloo and NCCL
deliver every byte. Here the real collective runs reliably and the loss is applied around it,
before any aggregation sees the data: a receiver replaces each lost packet with what it would
have without it (its stale copy, or nothing), or, for a sum, the sender leaves its lost packets
out of the sum it contributes, which gives the receiver exactly the sum of the packets that
arrived. The loss pattern of every packet is a pure function of (seed, step, stream, source,
destination, packet index) (a counter-based hash, no random state), so

* a run is reproducible: the same seed gives the same losses on any machine;
* every rank knows, without a message, which packets any other rank lost, which the
  simulation uses in two places a real transport would not need it: a sender masking its own
  lost packets, and a receiver counting arrivals (a real receiver sees which packets came).

``stream`` separates the messages of one step (the gradient reduce-scatter, the parameter
broadcast, each expert-parallel exchange): :class:`LossyTransport` numbers them in call order,
which is the same on every rank because every rank joins the same collectives in the same
order. A rank's packets to itself never cross the network and are never lost.

Loss models (:class:`LossConfig`): independent losses with probability p per packet, or
bursts (Gilbert's two-state channel, the Gilbert-Elliott model with loss probability 1 in
the bad state and 0 in the good one), a Markov chain along the packets of a message whose
stationary loss rate is p and whose mean burst length is ``burst_length`` packets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moe.parallel.exchange import group_rank_size, guarded

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class LossConfig:
    """How packets are lost. Validated on construction."""

    rate: float = 0.0
    """p: the probability that a packet is lost (for bursts: the stationary loss rate), in [0, 1)."""
    packet_size: int = 1024
    """Elements per packet (4 KiB of fp32 by default); a message's last packet may be shorter."""
    burst_length: float | None = None
    """None: packets lost independently. A number L >= 1: Gilbert's burst channel with mean
    burst length L packets (bad -> good with probability 1/L, good -> bad with p / (L (1 - p)),
    which must be <= 1)."""
    seed: int = 0
    """Seeds the loss pattern (with step, stream, source, destination and packet index)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"LossConfig.rate must be in [0, 1), got {self.rate!r}")
        if not isinstance(self.packet_size, int) or isinstance(self.packet_size, bool) or self.packet_size <= 0:
            raise ValueError(f"LossConfig.packet_size must be a positive integer, got {self.packet_size!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LossConfig.seed must be an integer >= 0, got {self.seed!r}")
        if self.burst_length is not None:
            if not self.burst_length >= 1.0:
                raise ValueError(f"LossConfig.burst_length must be None or >= 1, got {self.burst_length!r}")
            if self.rate > 0 and self.good_to_bad > 1.0:
                raise ValueError(
                    f"loss rate {self.rate} with mean burst length {self.burst_length} needs a good -> bad "
                    f"probability {self.good_to_bad:.3f} > 1: use longer bursts or a lower rate"
                )

    @property
    def good_to_bad(self) -> float:
        """Gilbert channel: probability of entering a burst after a delivered packet."""
        return self.rate / (self.burst_length * (1.0 - self.rate))

    def num_packets(self, n: int) -> int:
        """K: packets of a message of ``n`` elements."""
        return math.ceil(n / self.packet_size)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 (wrapping arithmetic): a bijection whose outputs for
    consecutive inputs pass as independent uniform 64-bit words."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def message_key(seed: int, step: int, stream: int, src: int, dst: int) -> int:
    """A 64-bit key for one message: each field hashed into the running key in turn."""
    key = np.zeros(1, dtype=np.uint64)
    for field in (seed, step, stream, src, dst):
        if field < 0:
            raise ValueError(f"message fields must be >= 0, got {(seed, step, stream, src, dst)}")
        key = _splitmix64(key ^ np.uint64(field & _MASK64))
    return int(key[0])


def packet_uniforms(key: int, num_packets: int) -> np.ndarray:
    """float64 [K] in [0, 1): packet k's draw is splitmix64(key + k), a function of (key, k) only."""
    with np.errstate(over="ignore"):
        words = _splitmix64(np.uint64(key) + np.arange(num_packets, dtype=np.uint64) * np.uint64(_GOLDEN))
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def lost_packets(cfg: LossConfig, step: int, stream: int, src: int, dst: int, num_packets: int) -> Tensor:
    """bool [K]: which packets of the message (step, stream, src -> dst) are lost; a pure
    function of its arguments. ``src == dst`` loses nothing."""
    if src == dst or cfg.rate == 0.0 or num_packets == 0:
        return torch.zeros(num_packets, dtype=torch.bool)
    u_K = packet_uniforms(message_key(cfg.seed, step, stream, src, dst), num_packets)
    if cfg.burst_length is None:
        return torch.from_numpy(u_K < cfg.rate)
    stay_bad, enter_bad = 1.0 - 1.0 / cfg.burst_length, cfg.good_to_bad
    lost_K = np.empty(num_packets, dtype=bool)
    bad = u_K[0] < cfg.rate  # the first packet sees the stationary distribution
    lost_K[0] = bad
    for k in range(1, num_packets):
        bad = u_K[k] < (stay_bad if bad else enter_bad)
        lost_K[k] = bad
    return torch.from_numpy(lost_K)


def expand_packets(mask_K: Tensor, n: int, packet_size: int) -> Tensor:
    """[n]: the per-packet ``mask_K`` repeated over the elements of each packet."""
    return mask_K.repeat_interleave(packet_size)[:n]


def shard_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's shard of a flat vector of ``n`` elements: contiguous, the
    first ``n % size`` shards one element longer (``torch.tensor_split``'s cut)."""
    base, extra = divmod(n, size)
    bounds, start = [], 0
    for r in range(size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class LossyTransport:
    """Lossy collectives over ``group`` with the loss pattern of ``cfg``.

    Every rank calls :meth:`begin_step` with the same step before the step's collectives;
    each collective then takes the next stream number. ``received`` and ``expected`` count
    this rank's incoming network packets since the last :meth:`begin_step` (packets to itself
    excluded), so ``received / expected`` is the delivered fraction.
    """

    def __init__(self, cfg: LossConfig, group=None):
        self.cfg = cfg
        self.group = group
        self.step = 0
        self._stream = 0
        self.received = 0
        self.expected = 0

    def begin_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step, self._stream, self.received, self.expected = step, 0, 0, 0

    def next_stream(self) -> int:
        stream, self._stream = self._stream, self._stream + 1
        return stream

    def lost_elements(self, stream: int, src: int, dst: int, n: int) -> Tensor:
        """bool [n]: the elements of message (step, stream, src -> dst) whose packet is lost."""
        lost_K = lost_packets(self.cfg, self.step, stream, src, dst, self.cfg.num_packets(n))
        return expand_packets(lost_K, n, self.cfg.packet_size)

    def _count(self, lost_K: Tensor) -> None:
        self.expected += lost_K.numel()
        self.received += int((~lost_K).sum())

    def reduce_scatter_sum(self, flat_n: Tensor, sender_scale: float = 1.0) -> tuple[Tensor, Tensor]:
        """(sum, arrivals) over this rank's shard (``shard_bounds``): ``sum`` adds the shard
        of every rank whose packet arrived (this rank's own always does), each other rank's
        contribution multiplied by ``sender_scale``; ``arrivals`` (same dtype) counts the
        contributions that arrived, per element. A collective over ``group``.

        Simulation: each sender zeroes the packets it loses before one reliable all-reduce
        (the reduce-scatter's result is this rank's shard of it; the simulation moves the whole
        vector where a real reduce-scatter moves 1/P of it). With nothing lost and scale 1 the
        buffer reduced is ``flat_n`` itself, so the sum is bitwise the reliable one."""
        rank, size = group_rank_size(self.group)
        stream = self.next_stream()
        bounds = shard_bounds(flat_n.numel(), size)
        buf = flat_n.clone()
        for dst, (lo, hi) in enumerate(bounds):
            if dst == rank:
                continue
            keep = ~self.lost_elements(stream, rank, dst, hi - lo).to(flat_n.device)
            part = buf[lo:hi]
            part.copy_(torch.where(keep, part * sender_scale, torch.zeros_like(part)))  # x * 1.0 == x bitwise
        guarded("lossy reduce-scatter", self.group, lambda: dist.all_reduce(buf, group=self.group))
        lo, hi = bounds[rank]
        arrivals = torch.ones(hi - lo, dtype=flat_n.dtype, device=flat_n.device)
        for src in range(size):
            if src != rank:
                lost_K = lost_packets(self.cfg, self.step, stream, src, rank, self.cfg.num_packets(hi - lo))
                self._count(lost_K)
                arrivals += ~expand_packets(lost_K, hi - lo, self.cfg.packet_size).to(flat_n.device)
        return buf[lo:hi], arrivals

    def all_gather_stale(self, shard: Tensor, stale_n: Tensor, reliable: bool = False) -> Tensor:
        """[n]: every rank's shard (``shard_bounds`` of n = ``stale_n.numel()``) gathered into
        one vector; an element of another rank's shard whose packet is lost keeps its value
        from ``stale_n``. ``reliable`` loses nothing (a resync). A collective over ``group``.

        Simulation: a reliable all-gather, then the receiver puts its stale values back
        where packets were lost."""
        rank, size = group_rank_size(self.group)
        stream = self.next_stream()
        bounds = shard_bounds(stale_n.numel(), size)
        if shard.numel() != bounds[rank][1] - bounds[rank][0]:
            raise ValueError(f"rank {rank} holds a shard of {shard.numel()} elements, expected {bounds[rank]}")
        width = max(hi - lo for lo, hi in bounds)
        padded = shard.new_zeros(width)
        padded[: shard.numel()] = shard
        parts = [torch.empty_like(padded) for _ in range(size)]
        guarded("lossy all-gather", self.group, lambda: dist.all_gather(parts, padded, group=self.group))
        out_n = stale_n.clone()
        for src, (lo, hi) in enumerate(bounds):
            got = parts[src][: hi - lo]
            if src == rank or reliable:
                out_n[lo:hi] = got
                continue
            lost_K = lost_packets(self.cfg, self.step, stream, src, rank, self.cfg.num_packets(hi - lo))
            self._count(lost_K)
            lost_S = expand_packets(lost_K, hi - lo, self.cfg.packet_size).to(stale_n.device)
            out_n[lo:hi] = torch.where(lost_S, stale_n[lo:hi], got)
        return out_n
