"""experiments/timing.py, the benchmarks' one harness, on fake clocks: every round runs every
variant (shuffled, seeded), warm-up rounds are dropped, a burst's time is per call, and the
medians, spread and per-round ratios are those of the samples worked out by hand; and every
script that imports it (or the row runner) runs from the repository root as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from experiments import timing


class FakeClocks:
    """Wall advances by what each call costs; CPU by half of it."""

    def __init__(self) -> None:
        self.wall = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.wall / 2


@pytest.fixture
def clocks(monkeypatch):
    fake = FakeClocks()
    monkeypatch.setattr(timing.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(timing.time, "process_time", fake.process_time)
    return fake


def test_interleaved_runs_every_variant_each_round_drops_warmup_and_divides_bursts(clocks):
    calls: list[str] = []
    costs = {"a": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0], "b": [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]}

    def variant(name: str):
        def run() -> None:
            calls.append(name)
            clocks.wall += costs[name][len([c for c in calls if c == name]) - 1]

        return run

    samples = timing.interleaved({"a": variant("a"), "b": variant("b")}, 2, warmup=1, burst=2, seed=3)
    # 3 rounds x 2 variants x a burst of 2: each round holds both variants' bursts, whole
    assert len(calls) == 12
    for r in range(3):
        round_calls = calls[4 * r : 4 * r + 4]
        assert sorted(round_calls) == ["a", "a", "b", "b"]
        assert round_calls[0] == round_calls[1] and round_calls[2] == round_calls[3]
    # round 0 is the warm-up; a sample is the burst's mean per call, CPU half of wall
    assert samples["a"].laps == [((3.0 + 5.0) / 2, 2.0), ((8.0 + 13.0) / 2, 5.25)]
    assert samples["b"].of("wall") == [35.0, 55.0]
    assert samples["a"].median("wall") == pytest.approx(7.25)
    assert samples["b"].spread("cpu") == (17.5, 27.5)
    r = timing.ratio(samples["a"], samples["b"], "wall")
    assert r["ratio"] == pytest.approx(7.25 / 45.0)
    assert (r["per_round_min"], r["per_round_max"]) == pytest.approx((4.0 / 35.0, 10.5 / 55.0))
    assert r["per_round_median"] == pytest.approx((4.0 / 35.0 + 10.5 / 55.0) / 2)


def test_the_order_is_shuffled_per_round_and_seeded(clocks):
    def orders(seed: int) -> list[tuple[str, ...]]:
        calls: list[str] = []
        timing.interleaved({n: (lambda n=n: calls.append(n)) for n in "abcd"}, 6, seed=seed)
        return [tuple(calls[i : i + 4]) for i in range(0, 24, 4)]

    first = orders(0)
    assert first == orders(0)
    assert len(set(first)) > 1  # not one fixed order: each variant's turn moves from round to round


def test_clocks_lap_and_timed_read_both_clocks_after_the_sync(clocks):
    synced: list[float] = []
    lap = timing.Clocks(sync=lambda: synced.append(clocks.wall))
    clocks.wall += 4.0
    assert lap.lap() == (4.0, 2.0)
    clocks.wall += 1.0
    assert lap.lap() == (1.0, 0.5)
    assert synced == [4.0, 5.0]

    def work() -> str:
        clocks.wall += 6.0
        return "out"

    assert timing.timed(work) == ("out", 6.0, 3.0)


def test_interleaved_phases_keep_each_phase_of_each_call_in_the_same_shuffled_rounds(clocks):
    calls: list[str] = []

    def phased(name: str, costs: dict[str, float]):
        def run(phases: timing.Phases) -> None:
            calls.append(name)
            for phase, cost in costs.items():
                clocks.wall += cost * len(calls)
                phases.end(phase)

        return run

    fns = {"a": phased("a", {"fwd": 1.0, "bwd": 2.0}), "b": phased("b", {"fwd": 10.0})}
    samples = timing.interleaved_phases(fns, 2, warmup=1, seed=3)
    plain: list[str] = []
    timing.interleaved({n: (lambda n=n: plain.append(n)) for n in "ab"}, 2, warmup=1, seed=3)
    assert calls == plain  # the rounds and orders of ``interleaved``
    # the k-th call (1-based, over all calls) costs its phases' costs times k; round 0 is dropped
    ka, kb = [k + 1 for k, n in enumerate(calls) if n == "a"][1:], [k + 1 for k, n in enumerate(calls) if n == "b"][1:]
    assert samples["a"]["fwd"].laps == [(1.0 * k, 0.5 * k) for k in ka]
    assert samples["a"]["bwd"].of("wall") == [2.0 * k for k in ka]
    assert set(samples["b"]) == {"fwd"} and samples["b"]["fwd"].of("cpu") == [5.0 * k for k in kb]
    assert samples["a"]["bwd"].medians() == {"wall_s": 2.0 * sum(ka) / 2, "cpu_s": sum(ka) / 2, "n": 2}


def test_interleaved_refuses_empty_rounds_and_bursts():
    with pytest.raises(ValueError, match="rounds >= 1"):
        timing.interleaved({"a": lambda: None}, 0)
    with pytest.raises(ValueError, match="burst >= 1"):
        timing.interleaved({"a": lambda: None}, 1, burst=0)
    with pytest.raises(ValueError, match="rounds >= 1"):
        timing.interleaved_phases({"a": lambda phases: None}, 0)


def test_no_benchmark_reads_a_clock_or_shuffles_its_rounds_itself():
    """Every benchmark times through the harness: none reads a clock or orders its rounds itself."""
    own = re.compile(r"time\.(perf_counter|process_time|time|monotonic)\b|random\.shuffle")
    benches = sorted((ROOT / "experiments").glob("bench_*.py"))
    assert len(benches) >= 13
    assert [f"{p.name}: {m.group()}" for p in benches for m in own.finditer(p.read_text())] == []


SCRIPTS = sorted(str(p) for p in (ROOT / "experiments").glob("*.py") if "from experiments" in p.read_text())
RUN_AS_SCRIPTS = """
import runpy, sys
base = [p for p in sys.path if p not in ("", ".")]
for script in sys.argv[1:]:
    sys.path[:] = [script.rsplit("/", 1)[0], *base]  # what python puts first for a script: its folder
    for name in [m for m in sys.modules if m == "experiments" or m.startswith("experiments.")]:
        del sys.modules[name]
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), script
    except ModuleNotFoundError as e:  # an optional extra (triton, scipy) this install lacks, never ours
        if e.name.split(".")[0] in ("experiments", "moe", "causal_moe_kernels"):
            raise
        print("lacks", e.name, script, file=sys.stderr)
        continue
    print("ran", script, file=sys.stderr)
"""


def test_the_scripts_that_import_their_siblings_run_as_their_docstrings_say():
    """``python experiments/X.py`` with no PYTHONPATH (the commands in the scripts' docstrings and
    in docs/) finds ``experiments.timing`` and ``experiments.rows``: each script, run as a script
    would be (its folder first on the path, no repository root, no PYTHONPATH), gets to --help."""
    assert len(SCRIPTS) >= 10
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", RUN_AS_SCRIPTS, *SCRIPTS],
        cwd="/",
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("ran ") + done.stderr.count("lacks ") == len(SCRIPTS), done.stderr[-3000:]
