"""The benchmarks' one timing harness: both clocks, warm-up, repeats, interleaving, medians and spread.

Every benchmark times through this module (``Clocks`` for one lap, ``interleaved`` for variants
compared with each other, ``interleaved_phases`` for the named phases inside one call), so each
reports the same statistics taken the same way:

* both clocks at once: wall time (``time.perf_counter``: what a user waits; on a GPU, after the
  ``sync`` the caller passes) and process CPU time (``time.process_time``: what this process got,
  the figure to read on a machine shared with other jobs);
* warm-up rounds that are run and not kept;
* the variants compared run interleaved: every round runs each once, in an order shuffled per
  round by a seeded generator, so a ratio is measured in one run, its two sides under the same load;
* a round's sample of a variant is the mean over a ``burst`` of calls (short calls are timed in
  bursts so that the clocks' resolution does not matter);
* medians over rounds, with the spread (smallest and largest sample), and per-round ratios.

On a CUDA device, ``cuda_ms`` times a kernel with Triton's ``do_bench`` (CUDA events, the L2
cache flushed before every call) instead.

    from experiments.timing import interleaved, ratio
    samples = interleaved({"dense": dense_step, "moe": moe_step}, rounds=7, warmup=1)
    samples["moe"].median("cpu"), ratio(samples["moe"], samples["dense"], "cpu")
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOCKS = ("wall", "cpu")


class Clocks:
    """Wall and process CPU time since the last ``lap`` (or since it was made)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """(wall, cpu) seconds since the last lap; ``sync`` (e.g. ``torch.cuda.synchronize``) first."""
        if self.sync is not None:
            self.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


class Phases(Clocks):
    """Named laps of one call cut into phases: ``end(name)`` closes the phase begun at the last
    ``end`` (or when it was made)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        super().__init__(sync)
        self.laps: dict[str, tuple[float, float]] = {}

    def end(self, name: str) -> None:
        self.laps[name] = self.lap()


def timed(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> tuple[object, float, float]:
    """One call of ``fn``: (its result, wall seconds, CPU seconds)."""
    clocks = Clocks(sync)
    out = fn()
    return (out, *clocks.lap())


@dataclass
class Samples:
    """One variant's samples, a (wall, cpu) pair per round, in round order."""

    laps: list[tuple[float, float]] = field(default_factory=list)

    def of(self, clock: str) -> list[float]:
        return [lap[CLOCKS.index(clock)] for lap in self.laps]

    def median(self, clock: str) -> float:
        return statistics.median(self.of(clock))

    def spread(self, clock: str) -> tuple[float, float]:
        """The smallest and the largest sample."""
        values = self.of(clock)
        return min(values), max(values)

    def medians(self) -> dict[str, float]:
        """Both clocks' medians and the number of samples: ``{"wall_s", "cpu_s", "n"}``."""
        return {"wall_s": self.median("wall"), "cpu_s": self.median("cpu"), "n": len(self.laps)}


def _rounds(names: list, rounds: int, warmup: int, seed: int):
    """(kept, name) for every call slot: ``warmup + rounds`` rounds, each every name once in an
    order shuffled per round (``random.Random(seed)``); ``kept`` is False in the warm-up rounds."""
    order, rng = list(names), random.Random(seed)
    for r in range(warmup + rounds):
        rng.shuffle(order)
        for name in order:
            yield r >= warmup, name


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 0,
    burst: int = 1,
    seed: int = 0,
    sync: Callable[[], None] | None = None,
) -> dict[str, Samples]:
    """name -> its samples: ``warmup + rounds`` rounds, each running every function ``burst``
    times in an order shuffled per round (``random.Random(seed)``); the first ``warmup`` rounds are
    dropped, a kept round's sample is the burst's time per call."""
    if rounds < 1 or burst < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, burst >= 1, warmup >= 0; got {rounds}, {burst}, {warmup}")
    samples = {name: Samples() for name in fns}
    for kept, name in _rounds(list(fns), rounds, warmup, seed):
        fn = fns[name]
        clocks = Clocks(sync)
        for _ in range(burst):
            fn()
        wall, cpu = clocks.lap()
        if kept:
            samples[name].laps.append((wall / burst, cpu / burst))
    return samples


def interleaved_phases(
    fns: dict[str, Callable[[Phases], object]],
    rounds: int,
    *,
    warmup: int = 0,
    seed: int = 0,
    sync: Callable[[], None] | None = None,
) -> dict[str, dict[str, Samples]]:
    """name -> phase -> its samples: the rounds of ``interleaved`` (one call a round), each call
    handed a fresh ``Phases`` whose ``end(phase)`` it calls after each of its phases."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, warmup >= 0; got {rounds}, {warmup}")
    samples: dict[str, dict[str, Samples]] = {name: {} for name in fns}
    for kept, name in _rounds(list(fns), rounds, warmup, seed):
        phases = Phases(sync)
        fns[name](phases)
        if kept:
            for phase, lap in phases.laps.items():
                samples[name].setdefault(phase, Samples()).laps.append(lap)
    return samples


def cuda_ms(fn: Callable[[], object]) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA device: ``triton.testing.do_bench``'s
    mean over 100 ms of calls after 25 ms of warm-up, the L2 cache flushed before each."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def ratio(num: Samples, den: Samples, clock: str) -> dict[str, float]:
    """``num`` over ``den`` on one clock: the ratio of the medians, and the smallest, median and
    largest of the per-round ratios (both sides of a round ran under the same load)."""
    per_round = sorted(a / b for a, b in zip(num.of(clock), den.of(clock), strict=True))
    return {
        "ratio": num.median(clock) / den.median(clock),
        "per_round_min": per_round[0],
        "per_round_median": statistics.median(per_round),
        "per_round_max": per_round[-1],
    }
