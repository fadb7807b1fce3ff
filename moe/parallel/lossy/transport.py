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


def message_keys(seed: int, step: int, stream: int, src_M: np.ndarray, dst_M: np.ndarray) -> np.ndarray:
    """uint64 [M]: a 64-bit key per message (step, stream, src_M[m] -> dst_M[m]): each field
    hashed into the running key in turn."""
    src_M, dst_M = np.asarray(src_M, dtype=np.int64), np.asarray(dst_M, dtype=np.int64)
    if min(seed, step, stream) < 0 or (src_M.size and min(src_M.min(), dst_M.min()) < 0):
        raise ValueError(f"message fields must be >= 0, got seed {seed}, step {step}, stream {stream}, "
                         f"sources {src_M.tolist()}, destinations {dst_M.tolist()}")
    key_M = np.zeros(src_M.shape, dtype=np.uint64)
    for field in (seed, step, stream, src_M, dst_M):
        key_M = _splitmix64(key_M ^ (np.asarray(field, dtype=np.uint64) & np.uint64(_MASK64)))
    return key_M


def message_key(seed: int, step: int, stream: int, src: int, dst: int) -> int:
    """The key of one message (:func:`message_keys` of one pair)."""
    return int(message_keys(seed, step, stream, np.array([src]), np.array([dst]))[0])


def packet_uniforms(key_M: np.ndarray, num_packets: int) -> np.ndarray:
    """float64 [M, K] in [0, 1): packet k of message m draws splitmix64(key_M[m] + k * golden), a
    function of (key, k) only, so a message's first packets do not depend on its length."""
    with np.errstate(over="ignore"):
        words = _splitmix64(np.asarray(key_M, dtype=np.uint64)[:, None]
                            + np.arange(num_packets, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN))
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def lost_packet_table(cfg: LossConfig, step: int, stream: int, src_M, dst_M, num_packets: int) -> np.ndarray:
    """bool [M, K]: which of the first K packets of each message (step, stream, src_M[m] ->
    dst_M[m]) are lost, a pure function of its arguments; a message to its own sender loses
    nothing. Row m is :func:`lost_packets` of that message (with any K' <= K packets: its prefix)."""
    src_M, dst_M = np.asarray(src_M, dtype=np.int64), np.asarray(dst_M, dtype=np.int64)
    lost_MK = np.zeros((src_M.size, num_packets), dtype=bool)
    if cfg.rate == 0.0 or num_packets == 0 or src_M.size == 0:
        return lost_MK
    u_MK = packet_uniforms(message_keys(cfg.seed, step, stream, src_M, dst_M), num_packets)
    if cfg.burst_length is None:
        lost_MK = u_MK < cfg.rate
    else:
        stay_bad, enter_bad = 1.0 - 1.0 / cfg.burst_length, cfg.good_to_bad
        bad_M = u_MK[:, 0] < cfg.rate  # the first packet sees the stationary distribution
        lost_MK[:, 0] = bad_M
        for k in range(1, num_packets):
            bad_M = u_MK[:, k] < np.where(bad_M, stay_bad, enter_bad)
            lost_MK[:, k] = bad_M
    lost_MK[src_M == dst_M] = False
    return lost_MK


def lost_packets(cfg: LossConfig, step: int, stream: int, src: int, dst: int, num_packets: int) -> Tensor:
    """bool [K]: which packets of the message (step, stream, src -> dst) are lost; a pure
    function of its arguments. ``src == dst`` loses nothing."""
    return torch.from_numpy(lost_packet_table(cfg, step, stream, [src], [dst], num_packets)[0])


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


@dataclass(frozen=True)
class Workers:
    """The data-parallel workers of the lossy collectives: ``size`` workers (ranks 0..size-1),
    of which this process holds the ones in ``local``; the others are held by the other
    processes of ``group``. One worker per process (:meth:`from_group`) is distributed
    training; every worker in one process (:meth:`in_process`) is the simulator
    (``moe.parallel.lossy.simulated``). A collective over the workers is a sum over the local
    ones followed, when ``distributed``, by an all-reduce over ``group``."""

    size: int
    local: tuple[int, ...]
    group: object = None
    distributed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1 or not self.local:
            raise ValueError(f"Workers needs size >= 1 and at least one local worker, got {self.size!r}, {self.local!r}")
        if any(not 0 <= r < self.size for r in self.local):
            raise ValueError(f"local workers {self.local} are not all in [0, {self.size})")

    @classmethod
    def from_group(cls, group=None) -> Workers:
        """This process is one worker, its rank in ``group`` (default: the world)."""
        rank, size = group_rank_size(group)
        return cls(size, (rank,), group, True)

    @classmethod
    def in_process(cls, size: int) -> Workers:
        """Every one of ``size`` workers lives in this process (no communication)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"workers must be a positive integer, got {size!r}")
        return cls(size, tuple(range(size)))

    def across_processes(self, t: Tensor, op: str = "sum") -> Tensor:
        """``t`` (a figure already combined over this process's workers) combined by ``op``
        ("sum" or "max") over the processes: an all-reduce when ``distributed``, in place."""
        if self.distributed:
            red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            guarded(f"lossy {op} all-reduce", self.group, lambda: dist.all_reduce(t, op=red, group=self.group))
        return t

    def _reduce(self, parts: list[Tensor], op: str) -> Tensor:
        if len(parts) != len(self.local):
            raise ValueError(f"{len(parts)} tensors for {len(self.local)} local workers")
        out = parts[0].clone()
        for part in parts[1:]:
            out = out + part if op == "sum" else torch.maximum(out, part)
        return self.across_processes(out, op)

    def sum(self, parts: list[Tensor]) -> Tensor:
        """The elementwise sum over every worker of its tensor (``parts``: the local workers')."""
        return self._reduce(parts, "sum")

    def max(self, parts: list[Tensor]) -> Tensor:
        """The elementwise maximum over every worker of its tensor."""
        return self._reduce(parts, "max")


class LossyTransport:
    """Lossy collectives among :class:`Workers` with the loss pattern of ``cfg``.

    Every process calls :meth:`begin_step` with the same step before the step's collectives;
    each collective then takes the next stream number. ``received`` and ``expected`` count the
    incoming network packets of this process's workers since the last :meth:`begin_step`
    (packets to oneself excluded), so ``received / expected`` is their delivered fraction.
    ``group`` is the process group of the expert-parallel exchanges
    (``moe.parallel.lossy.expert``), which use :meth:`next_stream` and :meth:`lost_elements`.
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

    def _shard_table(self, stream: int, n: int, size: int) -> tuple[list[tuple[int, int]], Tensor, Tensor, Tensor]:
        """The shards of a flat vector of ``n`` elements over ``size`` workers and the loss of the
        messages that carry them: (bounds, lost_PPK (bool [src, dst, packet]; for a message to dst
        the first ``num_packets`` of shard dst's length count), owner_n (the shard of each
        element), packet_n (the packet of each element within its shard))."""
        bounds = shard_bounds(n, size)
        lengths = [hi - lo for lo, hi in bounds]
        src_M, dst_M = np.divmod(np.arange(size * size), size)
        lost_MK = lost_packet_table(self.cfg, self.step, stream, src_M, dst_M, self.cfg.num_packets(max(lengths)))
        owner_n = torch.repeat_interleave(torch.arange(size), torch.tensor(lengths))
        packet_n = torch.cat([torch.arange(length) // self.cfg.packet_size for length in lengths])
        return bounds, torch.from_numpy(lost_MK).view(size, size, -1), owner_n, packet_n

    def _count(self, lost_MK: Tensor, length: int) -> None:
        """Count the network packets of the messages ``lost_MK`` (one row each) that carry a shard
        of ``length`` elements."""
        k = self.cfg.num_packets(length)
        self.expected += lost_MK.shape[0] * k
        self.received += int((~lost_MK[:, :k]).sum())

    def reduce_scatter_sum(self, flats_n: list[Tensor], workers: Workers,
                           sender_scale: float = 1.0) -> list[tuple[Tensor, Tensor]]:
        """Per local worker (as the owner of its shard, ``shard_bounds``): (sum, arrivals): ``sum``
        adds the shard of every worker whose packet arrived (the owner's own always does), each
        other worker's contribution multiplied by ``sender_scale``; ``arrivals`` (same dtype)
        counts the contributions that arrived, per element. ``flats_n``: the local workers'
        vectors. A collective over ``workers``.

        Simulation: each sender zeroes the packets it loses, then one reliable sum over the
        workers (an all-reduce between processes: the simulation moves the whole vector where a
        real reduce-scatter moves 1/P of it). With nothing lost and scale 1 the one worker per
        process reduces ``flat_n`` itself, so the sum is bitwise the reliable one."""
        stream = self.next_stream()
        bounds, lost_PPK, owner_n, packet_n = self._shard_table(stream, flats_n[0].numel(), workers.size)
        masked = []
        for src, flat_n in zip(workers.local, flats_n):
            keep_n = ~lost_PPK[src, owner_n, packet_n].to(flat_n.device)
            if sender_scale != 1.0:
                other_n = (owner_n != src).to(flat_n.device)
                flat_n = torch.where(other_n, flat_n * sender_scale, flat_n)
            masked.append(torch.where(keep_n, flat_n, torch.zeros_like(flat_n)))
        total_n = workers.sum(masked)
        out = []
        for dst in workers.local:
            lo, hi = bounds[dst]
            self._count(lost_PPK[[src for src in range(workers.size) if src != dst], dst], hi - lo)
            arrivals_S = (~lost_PPK[:, dst, packet_n[lo:hi]]).sum(0).to(total_n.dtype).to(total_n.device)
            out.append((total_n[lo:hi], arrivals_S))
        return out

    def all_gather_stale(self, shards: list[Tensor], stales_n: list[Tensor], workers: Workers,
                         reliable: bool = False) -> list[Tensor]:
        """Per local worker: [n], every worker's shard (``shard_bounds`` of n) gathered into one
        vector, where an element of another worker's shard whose packet is lost keeps its value
        from that local worker's ``stales_n`` entry; ``shards``: the local workers' own shards.
        ``reliable`` loses nothing (a resync). A collective over ``workers``.

        Simulation: a reliable sum of the shards placed in zero vectors (bitwise the shards:
        every other term is 0), then each receiver puts its stale values back where packets
        were lost."""
        stream = self.next_stream()
        n = stales_n[0].numel()
        bounds, lost_PPK, owner_n, packet_n = self._shard_table(stream, n, workers.size)
        placed = []
        for rank, shard in zip(workers.local, shards):
            lo, hi = bounds[rank]
            if shard.numel() != hi - lo:
                raise ValueError(f"worker {rank} holds a shard of {shard.numel()} elements, expected {hi - lo}")
            full_n = shard.new_zeros(n)
            full_n[lo:hi] = shard
            placed.append(full_n)
        gathered_n = workers.sum(placed)
        out = []
        for rank, stale_n in zip(workers.local, stales_n):
            if reliable:
                out.append(gathered_n.clone())
                continue
            for src, (lo, hi) in enumerate(bounds):
                if src != rank:
                    self._count(lost_PPK[src : src + 1, rank], hi - lo)
            lost_n = lost_PPK[owner_n, rank, packet_n].to(stale_n.device)
            out.append(torch.where(lost_n, stale_n, gathered_n))
        return out
