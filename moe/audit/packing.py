"""How many perturbed copies of the example share one forward, adapted to the target.

Packing copies along the batch saves the per-call overhead of tiny forwards, but a target whose
cost grows faster than its token count (a dense [N, E, C] dispatch with C proportional to N
costs N^2) gets slower per copy in a pack, and a large pack of it can run for minutes. So the
pack grows only while it pays. The doubling check
(:meth:`~moe.audit.comparator.Comparator.allow_batching`) times two copies in one forward:
packing starts at eight copies where the pair cost clearly less than two forwards, at four where
it cost about as much, and not at all where a copy cost clearly more in the pair than alone. A pack
doubles while its time per copy does not rise and the next pack is predicted (from the growth
seen so far) to stay under :data:`PACK_SECONDS`; it halves when a pack ran longer than that,
cost more per copy than a forward alone, or failed. Decisions read the fastest time seen at
each size, so one slow forward on a busy machine does not decide. A pack that fails or runs
past the time limit is re-run copy by copy: the target is judged NOT AUDITED only for its own
input. Which variants are compared never depends on these timings, only how many share a
forward.
"""

from __future__ import annotations

import math

MAX_ROWS = 512
"""Most samples in one packed forward."""
MAX_VALUES = 2**24
"""Most output values (float64 once compared: 128 MiB) in one packed forward."""
PACK_SECONDS = 0.5
"""Longest a packed forward is meant to take (at least 4 forwards of the example, at most a
quarter of the per-forward time limit)."""
GAIN = 0.8
"""Packing starts unless a copy costs more than 1 / GAIN of a forward of the example in a pair;
a pack grows while its time per copy is at most 1 / GAIN of the next smaller size's (amortised
overhead, not a cost that grows faster than the copies)."""


class Packer:
    """The pack size for one mode of one target: ``size`` copies per forward (below 3: no
    packing). Decisions read the fastest time seen at each size, so one slow forward on a busy
    machine neither stops nor shrinks packing."""

    def __init__(self, samples: int, values_per_copy: int, one_s: float, timeout: float | None) -> None:
        self.limit = max(1, min(MAX_ROWS // max(1, samples), MAX_VALUES // max(1, values_per_copy)))
        self.one_s = one_s
        self.cap_s = max(PACK_SECONDS, 4 * one_s)
        if timeout:
            self.cap_s = min(self.cap_s, timeout / 4)
        self.size = 1
        self._best: dict[int, float] = {1: one_s}
        """The fastest forward seen with this many copies."""

    @property
    def packs(self) -> bool:
        """Whether copies share forwards (a pack holds the example and at least two variants)."""
        return self.size >= 3

    def start(self, pair_s: float, one_s: float) -> bool:
        """Two copies took ``pair_s`` and one ``one_s`` (timed together): start packing at four
        copies unless a copy cost clearly more in the pair than alone (a cost that grows faster
        than the tokens) or four would pass the cap."""
        self.one_s = self._best[1] = min(self.one_s, one_s)
        self._best[2] = min(self._best.get(2, pair_s), pair_s)
        if self._best[2] / 2 <= self.one_s / GAIN and self._best[2] * 2 <= self.cap_s:
            # Eight copies at once where the pair cost clearly less than two forwards (overhead, not work).
            sublinear = self._best[2] <= 2 * GAIN * self.one_s and self._best[2] * 4 <= self.cap_s
            self.size = min(self.limit, 8 if sublinear else 4)
        return self.packs

    def observe(self, copies: int, seconds: float) -> None:
        """Adapt to a pack of ``copies`` (the example's copy included) that took ``seconds``."""
        if seconds > self.cap_s:
            self.size = max(1, self.size // 2)
            return
        if copies < self.size:  # a last, partial pack tells little
            return
        best = self._best[copies] = min(self._best.get(copies, seconds), seconds)
        smaller = max(k for k in self._best if k < copies)
        per, smaller_per = best / copies, self._best[smaller] / smaller
        if per > self.one_s / GAIN:  # slower per copy than one forward each: smaller packs
            self.size = max(1, copies // 2)
        elif per <= smaller_per / GAIN and self.size < self.limit:
            growth = math.log2(max(best / self._best[smaller], 1.0)) / math.log2(copies / smaller)
            if best * 2**growth <= self.cap_s:
                self.size = min(self.limit, 2 * copies)

    def failed(self) -> None:
        """A pack raised or ran past the time limit: smaller packs from now on."""
        self.size = max(1, self.size // 4)
