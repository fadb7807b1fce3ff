"""The packet-loss study's summary (experiments/packet_loss_report.py ``summarise``).

The perplexity change of a lossy run is paired by seed with the reliable run of the same seed:
100 (exp(val_loss - reliable val_loss) - 1) per seed, then mean and standard error.

The noise share: a step's
``grad_noise_share`` = sum_i |g_i - mean|^2 / (P^2 |mean|^2) is (P - 1) / P times the noise
share Var(mean) / |mean|^2 in expectation (moe.parallel.lossy.data_parallel), so the study
reports P / (P - 1) times each seed's mean over steps, then the mean and standard error over
seeds. Hand cases at P = 4 and P = 2, and the step figure of gradients drawn with a known
variance."""

from __future__ import annotations

import math

import numpy as np
import pytest

import experiments.packet_loss_report as study
from moe.parallel.lossy import METRICS


def record(
    workers: int, seed: int, noise_share_per_step: list[float], policy: str = "unbiased", val_loss: float = 3.0
) -> dict:
    """One run's record as the study stores it, every other figure a constant."""
    steps = len(noise_share_per_step)
    history = {k: [0.5] * steps for k in ("loss", *METRICS)}
    history["grad_noise_share"] = list(noise_share_per_step)
    return {
        "batch_size": 8,
        "workers": workers,
        "seed": seed,
        "loss_rate": 0.1,
        "policy": policy,
        "val_loss": val_loss,
        "tokens_per_step": 256,
        "history": history,
        "wall_s": 1.0,
    }


def test_noise_share_is_p_over_p_minus_1_times_the_step_figure():
    raw = [
        record(4, 0, [0.3, 0.9]),  # mean 0.6 -> 4/3 * 0.6 = 0.8
        record(4, 1, [0.1, 0.2]),  # mean 0.15 -> 0.2
        record(2, 0, [0.25]),  # 2/1 * 0.25 = 0.5
        record(2, 1, [0.3, 0.4]),  # mean 0.35 -> 0.7
    ]
    runs = {r["workers"]: r for r in study.summarise(raw)}
    # P = 4: seeds 0.8 and 0.2: mean 0.5, sample sd 0.6 / sqrt(2), standard error 0.3
    assert runs[4]["noise_share"] == pytest.approx(0.5, rel=1e-12)
    assert runs[4]["noise_share_se"] == pytest.approx(0.3, rel=1e-12)
    # P = 2: seeds 0.5 and 0.7: mean 0.6, standard error 0.1
    assert runs[2]["noise_share"] == pytest.approx(0.6, rel=1e-12)
    assert runs[2]["noise_share_se"] == pytest.approx(0.1, rel=1e-12)


@pytest.mark.parametrize("workers", [2, 5])
def test_noise_share_estimates_the_variance_of_the_mean_gradient(workers):
    """Per step, P gradients g_i = mu + noise (i.i.d., variance sigma^2 per element): the step
    figure of the definition above, fed to the study as a run's history, comes back as
    Var(mean) / |mu|^2 = n sigma^2 / (P |mu|^2), within 3 standard errors. E|mean|^2 is within
    0.01% of |mu|^2 here (n sigma^2 / P << |mu|^2), so dividing by the step's |mean|^2 instead
    biases the figure by far less than the test's resolution (1.5%)."""
    rng = np.random.default_rng(workers)
    n, sigma, steps = 400, 0.1, 200
    mu = np.full(n, 5.0)
    shares = []
    for _ in range(steps):
        g = mu + sigma * rng.standard_normal((workers, n))
        mean = g.mean(0)
        shares.append(float(((g - mean) ** 2).sum() / (workers**2 * (mean**2).sum())))
    half = steps // 2
    out = study.summarise([record(workers, 0, shares[:half]), record(workers, 1, shares[half:])])[0]
    truth = n * sigma**2 / (workers * float(mu @ mu))
    per_step = np.asarray(shares) * workers / (workers - 1)
    se = float(per_step.std(ddof=1) / math.sqrt(steps))
    assert abs(out["noise_share"] - truth) < 3 * se, (out["noise_share"], truth, se)
    # without the factor the figure is off by truth / P, with P / (P + 1) by more: over 6 standard errors
    assert 6 * se < truth / workers, (se, truth)


def test_perplexity_change_is_paired_by_seed():
    """Reliable seeds 0 and 1 end at 3.0 and 3.5, the lossy ones 0.01 and 0.02 above their own
    seed's: changes 100 (e^0.01 - 1) = 1.00502% and 100 (e^0.02 - 1) = 2.02013%."""
    raw = [
        record(4, 1, [0.1], "unbiased", 3.52),
        record(4, 0, [0.1], "reliable", 3.0),
        record(4, 1, [0.1], "reliable", 3.5),
        record(4, 0, [0.1], "unbiased", 3.01),
    ]
    runs = {r["policy"]: r for r in study.summarise(raw)}
    changes = [100 * math.expm1(0.01), 100 * math.expm1(0.02)]
    lossy = runs["unbiased"]
    assert lossy["ppl_change_per_seed"] == pytest.approx(changes, rel=1e-9)
    assert lossy["ppl_change_pct"] == pytest.approx(sum(changes) / 2, rel=1e-9)
    assert lossy["ppl_change_se"] == pytest.approx((changes[1] - changes[0]) / 2, rel=1e-9)
    assert runs["reliable"]["ppl_change_pct"] == 0.0


def test_the_curve_is_paired_by_seed_and_point_and_drift_is_the_largest():
    """Reliable seeds 0 and 1 evaluate 3.0 then 2.5, and 3.1 then 2.6; the lossy ones 3.01 then
    2.52, and 3.12 then 2.61. Per point: the mean loss over the seeds, the perplexity change
    against the same seed's same point (changes of 1% and 2%: 100 (e^0.01 - 1), 100 (e^0.02 - 1)),
    the largest drift over the seeds and the mean of the last. Over the run: the largest drift of
    any step of any seed, the seeds' perplexities' standard deviation in percent of their mean,
    and 8 sequences over 4 workers, 2 each."""

    def run(seed, policy, losses, drifts=(0.0, 0.0), lasts=(0.0, 0.0), history_drift=(0.0, 0.0)):
        r = record(4, seed, [0.1, 0.1], policy, losses[-1])
        r["history"]["max_drift"] = list(history_drift)
        r["curve"] = [
            {"step": step, "val_loss": v, "max_drift": d, "max_drift_last": last}
            for step, v, d, last in zip((10, 20), losses, drifts, lasts)
        ]
        return r

    raw = [
        run(0, "reliable", (3.0, 2.5)),
        run(1, "reliable", (3.1, 2.6)),
        run(0, "unbiased", (3.01, 2.52), (0.4, 0.2), (0.1, 0.05), (0.9, 0.2)),
        run(1, "unbiased", (3.12, 2.61), (0.6, 0.1), (0.3, 0.07), (0.3, 0.4)),
    ]
    lossy = {r["policy"]: r for r in study.summarise(raw)}["unbiased"]
    one, two = 100 * math.expm1(0.01), 100 * math.expm1(0.02)
    first, second = lossy["curve"]
    assert (first["step"], second["step"]) == (10, 20)
    assert first["val_loss"] == pytest.approx(3.065, rel=1e-12) and second["val_loss"] == pytest.approx(
        2.565, rel=1e-12
    )
    assert first["ppl_change_pct"] == pytest.approx((one + two) / 2, rel=1e-9)
    assert first["ppl_change_se"] == pytest.approx((two - one) / 2, rel=1e-9)
    assert second["ppl_change_pct"] == pytest.approx((two + one) / 2, rel=1e-9)
    assert (first["max_drift"], second["max_drift"]) == (0.6, 0.2)
    assert first["max_drift_last"] == pytest.approx(0.2) and second["max_drift_last"] == pytest.approx(0.06)
    assert lossy["max_drift"] == 0.9
    ppl = [math.exp(2.52), math.exp(2.61)]
    assert lossy["val_ppl_sd_pct"] == pytest.approx(100 * (ppl[1] - ppl[0]) / math.sqrt(2) / (sum(ppl) / 2), rel=1e-9)
    assert lossy["sequences_per_worker"] == 2 and lossy["tokens_per_step"] == 256
