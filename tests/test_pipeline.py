"""Pipeline parallelism (``moe.parallel.pipeline``) reproduces the single-process run.

The reference is independent of the pipeline code: ``train`` on one process, where the aux
losses are added to the loss. For ``ec_threshold`` without a load-balancing term every loss
is linear in the batch, so the plain run is the reference; for ``topk``, whose load-balancing
loss is not, the reference accumulates gradients over the same M microbatches
(``--microbatches M``). Tolerances: 1e-4 relative on per-step losses and aux losses, 1e-6 on
router state (the issue's); fp32 rounding of a different summation order is ~1e-7.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_parallel_train import COMMON, REL_TOL, _torchrun

from moe.model import MoETransformer, preset
from moe.parallel.pipeline import AuxLossInjector, StageModel, bubble_fraction, split_blocks
from moe.training import TrainConfig, config_from_args, train

EC = ["--router", "ec_threshold", "--router-option", "aux_loss_coef=0"]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_run(reference: list[dict], run: list[dict]) -> None:
    assert [r["step"] for r in run] == [r["step"] for r in reference] == list(range(1, 13))
    for key in ("loss", "aux_loss", "grad_norm"):
        rel = [abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(reference, run)]
        step = max(range(len(rel)), key=rel.__getitem__)
        assert rel[step] <= REL_TOL, f"{key} at step {step + 1}: {reference[step][key]!r} vs {run[step][key]!r}"
    assert [r["tokens_per_expert"] for r in run] == [r["tokens_per_expert"] for r in reference]
    for key in ("eval/teacher_forced_loss", "eval/causal_loss"):
        assert math.isclose(run[-1][key], reference[-1][key], rel_tol=REL_TOL), key


def _assert_same_state(exported, reference_model, router_tol: float = 1e-6) -> None:
    state = torch.load(exported, map_location="cpu", weights_only=False)["model"]
    reference = reference_model.state_dict()
    assert set(state) == set(reference)
    for key, ref in reference.items():
        tol = router_tol if ".router." in key and not key.endswith("gate.weight") else 1e-4
        diff = (state[key].double() - ref.double()).abs().max().item()
        assert diff <= tol * max(1.0, ref.double().abs().max().item()), f"{key}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_two_stages_match_single_process_ec_threshold(tmp_path, schedule):
    single = train(config_from_args([*COMMON, *EC]))
    jsonl, ckpt = tmp_path / "pp.jsonl", tmp_path / "ckpt"
    _torchrun(
        [
            *COMMON,
            *EC,
            "--pipeline-parallel",
            "2",
            "--microbatches",
            "2",
            "--pipeline-schedule",
            schedule,
            "--metrics-jsonl",
            str(jsonl),
            "--checkpoint-dir",
            str(ckpt),
            "--export-model",
        ],
        2,
    )
    _assert_same_run(single.history, _records(jsonl))
    _assert_same_state(ckpt / "model.pt", single.model)


def test_two_stages_times_expert_parallel_match_single_process(tmp_path):
    single = train(config_from_args([*COMMON, *EC]))
    jsonl, ckpt = tmp_path / "pp.jsonl", tmp_path / "ckpt"
    _torchrun(
        [
            *COMMON,
            *EC,
            "--pipeline-parallel",
            "2",
            "--expert-parallel",
            "2",
            "--microbatches",
            "2",
            "--metrics-jsonl",
            str(jsonl),
            "--checkpoint-dir",
            str(ckpt),
            "--export-model",
        ],
        4,
    )
    _assert_same_run(single.history, _records(jsonl))
    _assert_same_state(ckpt / "model.pt", single.model)


@pytest.mark.slow
def test_topk_pipeline_matches_microbatch_accumulation(tmp_path):
    # the Switch load-balancing loss plus the aux-loss-free balancing bias (router state)
    topk = ["--router-option", "balance_rate=0.01"]
    accumulated = train(config_from_args([*COMMON, *topk, "--microbatches", "4"]))
    plain = train(config_from_args([*COMMON, *topk]))
    jsonl, ckpt = tmp_path / "pp.jsonl", tmp_path / "ckpt"
    _torchrun(
        [
            *COMMON,
            *topk,
            "--pipeline-parallel",
            "2",
            "--microbatches",
            "4",
            "--metrics-jsonl",
            str(jsonl),
            "--checkpoint-dir",
            str(ckpt),
            "--export-model",
        ],
        2,
    )
    run = _records(jsonl)
    _assert_same_run(accumulated.history, run)
    _assert_same_state(ckpt / "model.pt", accumulated.model)
    assert accumulated.model.blocks[0].ffn.router.balance_bias.abs().max() > 0  # the bias did move
    # the load-balancing loss of a microbatch is not the batch's: accumulation is a different run
    aux_gap = max(abs(a["aux_loss"] - b["aux_loss"]) / a["aux_loss"] for a, b in zip(plain.history, run))
    assert aux_gap > 1e-3, f"microbatching should change topk's aux loss (max rel diff {aux_gap:.1e})"


@pytest.mark.slow
def test_interleaved_1f1b_matches_single_process(tmp_path):
    four = ["--n-layers", "4"]
    single = train(config_from_args([*COMMON, *EC, *four]))
    jsonl = tmp_path / "pp.jsonl"
    _torchrun(
        [
            *COMMON,
            *EC,
            *four,
            "--pipeline-parallel",
            "2",
            "--microbatches",
            "4",
            "--pipeline-schedule",
            "interleaved1f1b",
            "--metrics-jsonl",
            str(jsonl),
        ],
        2,
    )
    _assert_same_run(single.history, _records(jsonl))


@pytest.mark.slow
def test_pipeline_checkpoints_load_into_one_process_and_back(tmp_path):
    # 30 warmup steps: all 12 steps in warmup, so the 6-step half run's schedule is the 12-step run's
    ec = [*EC, "--warmup-steps", "30"]
    full = train(config_from_args([*COMMON, *ec]))
    ckpt = tmp_path / "ckpt"
    half = [a if a != "12" else "6" for a in COMMON]
    _torchrun([*half, *ec, "--pipeline-parallel", "2", "--microbatches", "2", "--checkpoint-dir", str(ckpt)], 2)
    resumed = train(config_from_args([*COMMON, *ec, "--checkpoint-dir", str(ckpt), "--resume"]))
    steps = [r["step"] for r in resumed.history]
    assert steps == list(range(7, 13))
    for a, b in zip(full.history[6:], resumed.history):
        assert math.isclose(a["loss"], b["loss"], rel_tol=REL_TOL), (a["step"], a["loss"], b["loss"])
    # and a single-process checkpoint resumed on a pipeline
    ckpt1 = tmp_path / "ckpt1"
    train(config_from_args([*half, *ec, "--checkpoint-dir", str(ckpt1)]))
    jsonl = tmp_path / "pp.jsonl"
    _torchrun(
        [
            *COMMON,
            *ec,
            "--pipeline-parallel",
            "2",
            "--microbatches",
            "2",
            "--checkpoint-dir",
            str(ckpt1),
            "--resume",
            "--metrics-jsonl",
            str(jsonl),
        ],
        2,
    )
    for a, b in zip(full.history[6:], _records(jsonl)[6:]):
        assert b["step"] == a["step"] and math.isclose(a["loss"], b["loss"], rel_tol=REL_TOL), (a, b)


def test_split_blocks_is_contiguous_and_balanced():
    assert split_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_blocks(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="at least 3 blocks"):
        split_blocks(2, 3)
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(1, 8) == 0.0


def test_aux_loss_injector_adds_the_aux_gradient():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    aux = (w.exp()).sum()
    out = AuxLossInjector.apply(x, aux)
    assert torch.equal(out, x)
    (out * 2).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((x_ref * 2).sum() + w_ref.exp().sum()).backward()
    assert torch.allclose(x.grad, x_ref.grad) and torch.allclose(w.grad, w_ref.grad)


def test_stage_models_partition_the_parameters_with_the_full_names():
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny", n_layers=4))
    names = {k for k, _ in model.named_parameters()}
    seen = set()
    for virtual in (1, 2):
        stages = [StageModel(model, r, 2, virtual) for r in range(2)]
        owned = [{k for k, _ in s.named_parameters()} for s in stages]
        assert owned[0] | owned[1] == names
        assert owned[0] & owned[1] == {"embed.weight"}  # tied: the last stage's head names it too
        seen |= {tuple(sorted(s.blocks)) for s in stages}
        assert all(set(s.state_dict()) <= set(model.state_dict()) for s in stages)
    assert ("0", "1") in seen and ("0", "2") in seen  # contiguous halves; interleaved takes every other


def test_pipeline_options_are_validated():
    with pytest.raises(ValueError, match="pipeline schedule must be one of"):
        TrainConfig.flat(pipeline_parallel=2, pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match="no packet_loss"):
        TrainConfig.flat(pipeline_parallel=2, packet_loss=0.1)
    with pytest.raises(ValueError, match="not divisible by microbatches"):
        TrainConfig.flat(batch_size=8, microbatches=3)
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        TrainConfig.flat(microbatches=0)
    with pytest.raises(ValueError, match="must divide the number of processes"):
        train(TrainConfig.flat(pipeline_parallel=2, steps=1, progress=False, wandb_mode="disabled", max_bytes=20000))
