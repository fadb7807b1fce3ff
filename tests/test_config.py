"""The run configuration: sections, TOML with command-line overrides, the resolved config
written beside the metrics, and step strategies registered from outside the package."""

import dataclasses
import json

import pytest
import torch

from moe.model import preset
from moe.training import TrainConfig, build_model, config_from_args, model_config, train
from moe.training.steps import STRATEGIES, choose_strategy, register_strategy
from moe.training.steps.plain import Plain

TINY_RUN = dict(
    seq_len=16,
    batch_size=4,
    max_bytes=50_000,
    eval_windows=2,
    eval_batch_size=2,
    causal_stride=8,
    warmup_steps=1,
    log_every=0,
    progress=False,
    wandb_mode="disabled",
    model={"d_model": 32, "moe_d_ff": 32},
)

RUN_TOML = """
seed = 3

[model]
router = "capacity"
[model.router_options]
top_k = 1
capacity_factor = 1.5
[model.overrides]
d_model = 32

[optimizer]
steps = 7
lr = 0.01

[parallel]
microbatches = 2
"""


def test_toml_then_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    expected = TrainConfig.flat(
        seed=3,
        router="capacity",
        router_options={"top_k": 1, "capacity_factor": 1.5},
        model={"d_model": 32},
        steps=7,
        lr=0.01,
        microbatches=2,
    )
    assert TrainConfig.load(path) == expected
    cfg = config_from_args(["--config", str(path), "--steps", "9", "--router-option", "priority=score"])
    assert cfg.optimizer.steps == 9 and cfg.optimizer.lr == 0.01 and cfg.seed == 3
    assert cfg.model.router_options == {"top_k": 1, "capacity_factor": 1.5, "priority": "score"}
    assert cfg.model.given() == {"d_model": 32} and cfg.parallel.microbatches == 2


def test_bad_files_and_values_name_the_problem(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nstpes = 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['stpes'\] in OptimizerConfig"):
        TrainConfig.load(path)
    with pytest.raises(ValueError, match="not found"):
        TrainConfig.load(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown TrainConfig field 'stpes'"):
        TrainConfig.flat(stpes=3)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        TrainConfig.flat(batch_size=0)


def test_resolved_config_is_written_beside_the_metrics_and_reloads(tmp_path):
    run = dict(metrics_jsonl=str(tmp_path / "run" / "m.jsonl"), checkpoint_dir=str(tmp_path / "run"), **TINY_RUN)
    cfg = TrainConfig.flat(steps=2, **run)
    train(cfg)
    written = tmp_path / "run" / "m.config.json"
    first = json.loads(written.read_text())
    assert first["optimizer"]["steps"] == 2 and TrainConfig.load(written) == cfg
    # the model as built, not the overrides given: the tiny preset with d_model and moe_d_ff set
    built = dataclasses.asdict(preset("tiny", d_model=32, moe_d_ff=32, vocab_size=256))
    assert first["model"]["overrides"]["n_layers"] is None and first["model_config"] == built
    # a resume keeps the first invocation's config and adds its own (schedule resolved: kept at 2)
    train(TrainConfig.flat(steps=3, resume=True, **run))
    record = json.loads(written.read_text())
    assert [i["started_at_step"] for i in record["invocations"]] == [0, 2]
    assert record["invocations"][0]["config"] == {k: first[k] for k in dataclasses.asdict(cfg)}
    assert record["invocations"][1]["config"]["optimizer"] == {
        **first["optimizer"],
        "steps": 3,
        "schedule_steps": 2,
    }
    assert TrainConfig.load(written) == TrainConfig.flat(steps=3, schedule_steps=2, resume=True, **run)
    # a fresh start with the same metrics path is refused and changes nothing; another path begins a new record
    metrics = (tmp_path / "run" / "m.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"m\.jsonl holds another run's metrics: add --resume"):
        train(TrainConfig.flat(steps=1, **{**run, "checkpoint_dir": str(tmp_path / "other")}))
    assert (tmp_path / "run" / "m.jsonl").read_bytes() == metrics and not (tmp_path / "other").exists()
    train(TrainConfig.flat(steps=1, **{**run, "metrics_jsonl": str(tmp_path / "new.jsonl"), "checkpoint_dir": None}))
    assert [i["started_at_step"] for i in json.loads((tmp_path / "new.config.json").read_text())["invocations"]] == [0]


def test_the_config_selects_one_strategy():
    assert choose_strategy(TrainConfig()).name == "plain"
    assert choose_strategy(TrainConfig.flat(microbatches=4)).name == "plain"
    assert choose_strategy(TrainConfig.flat(pipeline_parallel=2)).name == "pipelined"
    assert choose_strategy(TrainConfig.flat(packet_loss=0.1)).name == "lossy"


def test_a_strategy_registered_from_outside_the_package_runs(monkeypatch):
    """A new way of stepping is one class: registered here, it is chosen and run by the loop."""
    calls = []

    class Frozen(Plain):
        """Gradients as usual, no update: the weights must stay those of the initialisation."""

        name = "frozen-test"

        @staticmethod
        def selected(cfg) -> bool:
            return cfg.logging.wandb_run_name == "frozen"

        def update(self, step: int) -> tuple[float, dict]:
            calls.append(step)
            return 0.0, {"frozen": 1.0}

    monkeypatch.setattr("moe.training.steps.base.STRATEGIES", dict(STRATEGIES))
    register_strategy(Frozen)
    cfg = TrainConfig.flat(steps=3, wandb_run_name="frozen", **TINY_RUN)
    res = train(cfg)
    assert calls == [1, 2, 3]
    assert [r["frozen"] for r in res.history] == [1.0, 1.0, 1.0]
    init = build_model(model_config(cfg.model, 256), cfg.seed, torch.device("cpu"))
    for (name, a), b in zip(init.state_dict().items(), res.model.state_dict().values()):
        assert torch.equal(a, b), name
