"""Balance metrics (MaxVio, dead experts, the tokens-per-expert spread, experts per token): hand
cases, the training records under microbatches and pipeline stages against one plain step,
the global figures of an evaluation, and evaluations that leave a run exactly as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_RUN

from moe.balance import active_experts_summary, balance_summary, max_violation
from moe.parallel.launch import ok_values, run_local
from moe.training import TrainConfig, train
from moe.training.metrics import wandb_flat

BALANCE_KEYS = ("max_vio", "max_vio_worst", "dead_experts", "active_experts_mean", "tokens_per_expert")


def test_max_vio_dead_experts_and_spread_by_hand():
    tokens_LE = torch.tensor([[3, 1, 0, 0], [2, 2, 2, 2]])
    assert max_violation(tokens_LE).tolist() == [2.0, 0.0]  # max 3 / mean 1 - 1; perfect balance
    s = balance_summary(tokens_LE)
    assert s["max_vio"] == 1.0 and s["max_vio_worst"] == 2.0 and s["max_vio_layers"] == [2.0, 0.0]
    assert s["dead_experts"] == 2 and s["dead_experts_layers"] == [2, 0]
    assert s["tokens_per_expert_min"] == [0.0, 2.0] and s["tokens_per_expert_max"] == [3.0, 2.0]
    assert s["tokens_per_expert_p50"] == [0.5, 2.0]  # sorted 0, 0, 1, 3: halfway between 0 and 1
    assert s["tokens_per_expert_p10"] == [0.0, 2.0]  # 0.3 of the way from the first 0 to the second
    assert s["tokens_per_expert_p90"] == pytest.approx([2.4, 2.0], rel=1e-12)  # 0.7 of the way from 1 to 3
    assert max_violation(torch.zeros(1, 4, dtype=torch.long)).tolist() == [0.0]  # no token: no violation
    a = active_experts_summary(torch.tensor([[1, 2, 1], [0, 0, 4]]), "global_")  # tokens with 0, 1, 2 experts
    assert a["global_active_experts_mean"] == pytest.approx((2 + 2 + 8) / 8)
    assert a["global_active_experts_layers"] == pytest.approx([1.0, 2.0])
    assert a["global_active_experts_hist"] == [1, 2, 5]


def test_wandb_gets_every_balance_figure_as_a_scalar():
    flat = wandb_flat(
        {
            "step": 3,
            "max_vio": 0.5,
            "max_vio_layers": [0.4, 0.6],
            "active_experts_hist": [1, 2],
            "tokens_per_expert": [],
        }
    )
    assert flat == {
        "max_vio": 0.5,
        "max_vio_layers/layer0": 0.4,
        "max_vio_layers/layer1": 0.6,
        "active_experts_hist/0": 1,
        "active_experts_hist/1": 2,
    }
    assert wandb_flat({"eval/global_active_experts_hist": [3, 4]}) == {
        "eval/global_active_experts_hist/0": 3,
        "eval/global_active_experts_hist/1": 4,
    }


def _balance(history: list[dict]) -> list[tuple]:
    return [tuple(str(r[k]) for k in BALANCE_KEYS) for r in history]


def test_microbatches_report_the_balance_of_the_whole_step():
    """Top-k routes each token alone, so two microbatches of the first step route exactly as one
    batch does: the step's counts, and every figure read from them, are the same. (Later steps
    start from weights that differ in the last bits, the accumulated gradient's rounding.)"""
    one = train(TrainConfig.flat(**{**TINY_RUN, "steps": 1}))
    two = train(TrainConfig.flat(**{**TINY_RUN, "steps": 1, "microbatches": 2}))
    assert _balance(one.history) == _balance(two.history)
    assert one.history[0]["max_vio"] > 0 and 0 <= one.history[0]["dead_experts"] <= 8


def _pipeline_worker(rank: int, world: int) -> list[dict]:
    torch.set_num_threads(1)
    res = train(TrainConfig.flat(**{**TINY_RUN, "steps": 1, "pipeline_parallel": 2, "microbatches": 2}))
    return res.history


def test_pipeline_stages_report_the_balance_of_every_layer():
    ref = train(TrainConfig.flat(**{**TINY_RUN, "steps": 1}))
    history = ok_values(run_local(_pipeline_worker, 2, timeout_s=300))[0]
    assert _balance(history) == _balance(ref.history)


@pytest.mark.parametrize(
    "router,options",
    [
        ("topk", {"balance_rate": 0.01, "aux_loss_coef": 0.0}),
        ("ec_threshold", {"statistic": "population"}),
        ("ec_threshold", {}),
        ("remoe", {}),
        ("top_p", {"target_experts": 2}),
    ],
)
def test_evaluations_between_steps_leave_the_run_bitwise_as_it_was(router, options):
    """Routers that learn from batches count only training forwards: evaluating after every
    step changes no loss, gradient or routing of the steps that follow."""
    run = {**TINY_RUN, "steps": 6, "router": router, "router_options": options}
    plain = train(TrainConfig.flat(**run)).history
    evaluated = train(TrainConfig.flat(**run, eval_every=1)).history
    keys = ("loss", "aux_loss", "grad_norm", "tokens_per_expert")
    assert [[r[k] for k in keys] for r in plain] == [[r[k] for k in keys] for r in evaluated]
    assert "eval/global_max_vio" in evaluated[0] and "eval/global_active_experts_mean" in evaluated[0]
