"""A simulated lossy transport on top of ``torch.distributed``: messages cut into packets,
packets lost at random, the loss pattern a pure function of where and when a packet travels.

Shape legend: P workers (ranks), L of them held by this process, n elements in a message (a
flat tensor), K packets of a message (K = ceil(n / packet_size)), M messages.

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

**Workers** (:class:`Workers`): the data-parallel collectives run among P workers, one per
process (training over ``torch.distributed``) or all in one process (the simulator,
``moe.parallel.lossy.simulated``); a sum over the workers is a sum over the process's own
followed by an all-reduce between processes. Worker j's packets are lost alike either way.

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
        raise ValueError(
            f"message fields must be >= 0, got seed {seed}, step {step}, stream {stream}, "
            f"sources {src_M.tolist()}, destinations {dst_M.tolist()}"
        )
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
        words = _splitmix64(
            np.asarray(key_M, dtype=np.uint64)[:, None]
            + np.arange(num_packets, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN)
        )
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
            raise ValueError(
                f"Workers needs size >= 1 and at least one local worker, got {self.size!r}, {self.local!r}"
            )
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

    def _reduce(self, parts_L: Tensor, op: str) -> Tensor:
        if parts_L.shape[0] != len(self.local):
            raise ValueError(f"{parts_L.shape[0]} tensors for {len(self.local)} local workers")
        out = parts_L.sum(0) if op == "sum" else parts_L.amax(0)
        return self.across_processes(out, op)

    def sum(self, parts_L: Tensor) -> Tensor:
        """The elementwise sum over every worker of its tensor (``parts_L``: the local workers',
        stacked along dim 0)."""
        return self._reduce(parts_L, "sum")

    def max(self, parts_L: Tensor) -> Tensor:
        """The elementwise maximum over every worker of its tensor (stacked as for :meth:`sum`)."""
        return self._reduce(parts_L, "max")


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

    def _shard_table(self, stream: int, n: int, size: int) -> _ShardTable:
        bounds = shard_bounds(n, size)
        lengths = torch.tensor([hi - lo for lo, hi in bounds])
        packets_P = (lengths + self.cfg.packet_size - 1) // self.cfg.packet_size
        width = int(packets_P.max())
        src_M, dst_M = np.divmod(np.arange(size * size), size)
        lost_PPK = torch.from_numpy(lost_packet_table(self.cfg, self.step, stream, src_M, dst_M, width)).view(
            size, size, width
        )
        owner_n = torch.repeat_interleave(torch.arange(size), lengths)
        packet_n = torch.cat([torch.arange(int(length)) // self.cfg.packet_size for length in lengths])
        return _ShardTable(bounds, lost_PPK, packets_P, owner_n, owner_n * width + packet_n, packet_n)

    def _count(self, lost_PPK: Tensor, valid_PPK: Tensor, receivers: list[int]) -> None:
        """Count the network packets (``valid_PPK``: [src, dst, packet] of real messages) that
        this process's ``receivers`` expected and received."""
        valid = valid_PPK[:, receivers]
        self.expected += int(valid.sum())
        self.received += int((valid & ~lost_PPK[:, receivers]).sum())

    def reduce_scatter_sum(
        self, flats_Ln: Tensor, workers: Workers, sender_scale: float = 1.0
    ) -> list[tuple[Tensor, Tensor]]:
        """Per local worker (as the owner of its shard, ``shard_bounds``): (sum, arrivals): ``sum``
        adds the shard of every worker whose packet arrived (the owner's own always does), each
        other worker's contribution multiplied by ``sender_scale``; ``arrivals`` (same dtype)
        counts the contributions that arrived, per element. ``flats_Ln``: the local workers'
        vectors, stacked. A collective over ``workers``.

        Simulation: each sender zeroes the packets it loses, then one reliable sum over the
        workers (an all-reduce between processes: the simulation moves the whole vector where a
        real reduce-scatter moves 1/P of it). With nothing lost and scale 1 the one worker per
        process reduces its ``flat_n`` itself, so the sum is bitwise the reliable one."""
        stream = self.next_stream()
        size, local = workers.size, list(workers.local)
        tab = self._shard_table(stream, flats_Ln.shape[1], size)
        device = flats_Ln.device
        if sender_scale != 1.0:  # x * 1.0 == x bitwise, but skip the pass
            own_Ln = tab.owner_n.to(device)[None, :] == torch.tensor(local, device=device)[:, None]
            flats_Ln = torch.where(own_Ln, flats_Ln, flats_Ln * sender_scale)
        lost_Ln = tab.lost_PPK[local].reshape(len(local), -1).index_select(1, tab.flat_packet_n).to(device)
        total_n = workers.sum(torch.where(lost_Ln, 0.0, flats_Ln))
        carries_PPK = torch.arange(tab.lost_PPK.shape[2])[None, None, :] < tab.packets_P[None, :, None]  # shard dst
        self._count(tab.lost_PPK, carries_PPK & ~torch.eye(size, dtype=torch.bool)[:, :, None], local)
        arrivals_LK = (~tab.lost_PPK[:, local]).sum(0).to(flats_Ln.dtype).to(device)
        out = []
        for i, dst in enumerate(local):
            lo, hi = tab.bounds[dst]
            out.append((total_n[lo:hi], arrivals_LK[i, tab.packet_n[lo:hi]]))
        return out

    def all_gather_stale(
        self, shards: list[Tensor], stales_Ln: Tensor, workers: Workers, reliable: bool = False
    ) -> Tensor:
        """[L, n]: per local worker, every worker's shard (``shard_bounds`` of n) gathered into one
        vector, where an element of another worker's shard whose packet is lost keeps its value
        from that local worker's row of ``stales_Ln``; ``shards``: the local workers' own shards.
        ``reliable`` loses nothing (a resync). A collective over ``workers``.

        Simulation: a reliable sum of the shards placed in zero vectors (bitwise the shards:
        every other term is 0), then each receiver puts its stale values back where packets
        were lost."""
        stream = self.next_stream()
        size, local = workers.size, list(workers.local)
        n = stales_Ln.shape[1]
        tab = self._shard_table(stream, n, size)
        placed_Ln = stales_Ln.new_zeros(len(local), n)
        for i, (rank, shard) in enumerate(zip(local, shards)):
            lo, hi = tab.bounds[rank]
            if shard.numel() != hi - lo:
                raise ValueError(f"worker {rank} holds a shard of {shard.numel()} elements, expected {hi - lo}")
            placed_Ln[i, lo:hi] = shard
        gathered_n = workers.sum(placed_Ln)
        if reliable:
            return gathered_n.expand(len(local), n).clone()
        lost_recv_PPK = tab.lost_PPK.transpose(0, 1)  # [receiver, owner, packet]
        carries_PPK = torch.arange(tab.lost_PPK.shape[2])[None, None, :] < tab.packets_P[:, None, None]  # shard src
        self._count(tab.lost_PPK, carries_PPK & ~torch.eye(size, dtype=torch.bool)[:, :, None], local)
        lost_Ln = lost_recv_PPK[local].reshape(len(local), -1).index_select(1, tab.flat_packet_n).to(stales_Ln.device)
        return torch.where(lost_Ln, stales_Ln, gathered_n[None, :])


@dataclass
class _ShardTable:
    """A flat vector of n elements cut into the shards of P workers, and the loss of the
    messages of one stream that carry them."""

    bounds: list[tuple[int, int]]
    """[start, stop) of each worker's shard (``shard_bounds``)."""
    lost_PPK: Tensor
    """bool [src, dst, packet]: packet k of the message src -> dst lost (K: the longest shard's
    packets; a message carries as many packets as its shard has)."""
    packets_P: Tensor
    """Packets of each shard."""
    owner_n: Tensor
    """int64 [n]: the shard (owner) of each element."""
    flat_packet_n: Tensor
    """int64 [n]: owner * K + packet of each element: its packet's column in ``lost_PPK[s].reshape(-1)``."""
    packet_n: Tensor
    """int64 [n]: the packet of each element within its shard."""
