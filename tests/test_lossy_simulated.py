"""The in-process simulator of P data-parallel workers (``moe.parallel.lossy.simulated``, driven
by ``experiments/packet_loss.py``'s ``simulate``) is the real thing at small P: at P = 4 it
reproduces the training loop's run on 4 gloo processes (``train`` with ``packet_loss``) of the
same seed, reliable and lossy.

Tolerance: every step's training loss within 1e-6 relative (the issue's figure). The two differ
only in how sums over workers are ordered (a fixed order here, gloo's all-reduce there), fp32
rounding of about 1e-7 per sum; 8 steps of AdamW do not amplify it past 1e-6 (measured: below
1e-6 on both policies). The loss pattern is the same pure function on both sides, so the
delivered fraction must agree exactly. The lossy pair (unbiased at p = 0.3) runs by default,
the reliable one with ``-m slow``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from experiments.packet_loss import simulate
from moe.data import load_corpus
from moe.eval import evaluate
from moe.parallel.launch import ok_values, run_local
from moe.parallel.lossy import LossyDPConfig, SimulatedDataParallel
from moe.training import TrainConfig, train

WORKERS = 4
REL_TOL = 1e-6
MAX_BYTES = 200_000
POLICIES = ("reliable", "unbiased")


def _config(policy: str) -> TrainConfig:
    return TrainConfig.flat(
        preset="tiny",
        model={"n_layers": 1},
        router_options={"aux_loss_coef": 0.0, "balance_rate": 0.01},
        max_bytes=MAX_BYTES,
        seq_len=32,
        batch_size=8,
        steps=8,
        warmup_steps=2,
        eval_windows=4,
        causal_stride=32,
        log_every=0,
        progress=False,
        wandb_mode="disabled",
        packet_loss=0.3,
        loss_policy=policy,
        loss_packet_size=64,
        seed=3,
    )


def _processes(rank: int, world: int, policy: str) -> dict:
    corpus = load_corpus("stdlib", max_bytes=MAX_BYTES)
    res = train(_config(policy), corpus)
    ev = evaluate(res.model, corpus.val, 32, 4, device=torch.device("cpu"), causal=False)
    return {
        "loss": [r["loss"] for r in res.history],
        "received": [r["received_fraction"] for r in res.history],
        "grad_rel_error": [r["grad_rel_error"] for r in res.history],
        "val_loss": ev["teacher_forced_loss"],
    }


@functools.cache
def _pair(policy: str) -> tuple[dict, dict]:
    """(the 4-process run's rank-0 figures, the simulator's run) of one policy."""
    procs = ok_values(run_local(_processes, WORKERS, policy, timeout_s=300.0))[0]
    return procs, simulate(_config(policy), WORKERS, load_corpus("stdlib", max_bytes=MAX_BYTES))


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(x) for x, y in zip(a, b)]


def _check(policy: str) -> dict:
    procs, sim = _pair(policy)
    assert len(sim["history"]["loss"]) == len(procs["loss"]) == 8
    rel = _rel(procs["loss"], sim["history"]["loss"])
    assert max(rel) <= REL_TOL, (
        f"{policy}: training loss differs, max rel {max(rel):.2e} at step {rel.index(max(rel)) + 1}, "
        f"mean rel {sum(rel) / len(rel):.2e}"
    )
    assert sim["history"]["received_fraction"] == procs["received"], f"{policy}: different packets lost"
    val_rel = abs(sim["val_loss"] - procs["val_loss"]) / procs["val_loss"]
    assert val_rel <= REL_TOL, f"{policy}: final validation loss {sim['val_loss']:.7f} vs {procs['val_loss']:.7f}"
    return sim


def test_simulator_reproduces_four_lossy_gloo_processes():
    sim = _check("unbiased")
    procs = _pair("unbiased")[0]
    assert min(procs["received"]) < 0.8, "hardly anything lost at p = 0.3: the lossy comparison is vacuous"
    err_rel = _rel(procs["grad_rel_error"], sim["history"]["grad_rel_error"])
    assert max(err_rel) < 1e-4, f"gradient error figures differ: max rel {max(err_rel):.2e}"


@pytest.mark.slow
def test_simulator_reproduces_four_reliable_gloo_processes():
    sim = _check("reliable")
    # the lossy comparison would pass trivially if the policy were ignored
    assert sim["history"]["loss"][-1] != _pair("unbiased")[1]["history"]["loss"][-1]


def test_bad_simulator_inputs_raise():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="workers"):
        SimulatedDataParallel(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), LossyDPConfig(), workers=1)
    cfg = TrainConfig.flat(preset="tiny", max_bytes=MAX_BYTES, seq_len=32, batch_size=8, steps=1, packet_loss=0.1)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        simulate(cfg, WORKERS, load_corpus("stdlib", max_bytes=MAX_BYTES))
