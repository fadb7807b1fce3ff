"""Edges of the trainer's checks and reports that the run tests leave open, each with its
expected answer worked out by hand: the worse-than-uniform warning's threshold (2 ln V), the
free-space check at exactly one checkpoint, the step tally's dropped fraction (a mean over MoE
layers, not a sum), the recorded config and metrics JSONL of a fresh start and of a resume at
step 1, the log line of a last step off the ``log_every`` grid, and the config checks at their
boundaries (sequence length, causal stride, burst length, vocabulary, one window of data)."""

from __future__ import annotations

import json
import math
import sys
from collections import namedtuple

import pytest
import torch

from moe.data import Corpus
from moe.model import preset
from moe.training import TrainConfig
from moe.training.batches import DataConfig, check_vocabulary
from moe.training.distributed import DistInfo
from moe.training.guards import check_room, worse_than_uniform
from moe.training.metrics import StepTally
from moe.training.report import RunReport, init_wandb, record_config

DiskUsage = namedtuple("DiskUsage", "total used free")


def test_worse_than_uniform_is_above_twice_ln_v():
    """V = 100: ln V = 4.605, the threshold 9.210; 9.0 is not worse, 9.3 is."""
    assert 2 * math.log(100) == pytest.approx(9.2103, abs=1e-4)
    assert not worse_than_uniform(9.0, 100)
    assert worse_than_uniform(9.3, 100)


def test_check_room_refuses_one_byte_short(tmp_path, monkeypatch):
    monkeypatch.setattr("moe.training.guards.shutil.disk_usage", lambda _: DiskUsage(10_000, 9_000, 1_000))
    check_room(tmp_path, 1_000)  # exactly one checkpoint's room
    with pytest.raises(ValueError, match="needs at least"):
        check_room(tmp_path, 1_001)
    with pytest.raises(ValueError, match="needs at least"):
        check_room(tmp_path, 1_900)


def test_step_tally_averages_over_layers_and_microbatches():
    """Two MoE layers, two microbatches: the dropped fraction is the mean of the four routings'
    (0.2, 0.4, 0.0, 0.2 -> 0.2); the aux loss the sum over layers averaged over microbatches
    ((0.1 + 0.3 + 0.5 + 0.1) / 2 = 0.5); the loss the mean over microbatches."""
    tally = StepTally(num_moe_layers=2, num_experts=2, device=torch.device("cpu"))
    for loss, layers in (
        (2.0, [(0.1, 0.2, [3, 1]), (0.3, 0.4, [2, 2])]),
        (4.0, [(0.5, 0.0, [1, 3]), (0.1, 0.2, [0, 4])]),
    ):
        tally.add_loss(torch.tensor(loss, dtype=torch.float64))
        tally.add_microbatches()
        for layer, (aux, dropped, tokens) in enumerate(layers):
            hist = torch.tensor([0, sum(tokens), 0])
            f64 = torch.float64
            tally.add_routing(
                layer, torch.tensor(aux, dtype=f64), torch.tensor(dropped, dtype=f64), torch.tensor(tokens), hist
            )
    record = tally.finish((torch.tensor(0.0), torch.tensor(0.0)))
    assert record["dropped_fraction"] == pytest.approx(0.2, abs=1e-12)
    assert record["aux_loss"] == pytest.approx(0.5, abs=1e-12)
    assert record["loss"] == pytest.approx(3.0, abs=1e-12)
    assert record["tokens_per_expert"] == [[4, 4], [2, 6]]
    assert record["expert_load"] == [[0.5, 0.5], [0.25, 0.75]]


def test_step_tally_keeps_each_layers_experts_per_token():
    """Layer 0 routes its 4 tokens to 0, 1, 1 and 2 experts, layer 1 each of them to 2: per layer
    1.0 and 2.0 experts per token, (4 + 8) / 8 = 1.5 over both, the histogram summed over layers;
    MaxVio from each layer's own counts; the router entropy per gate call."""
    tally = StepTally(num_moe_layers=2, num_experts=2, device=torch.device("cpu"))
    zero = torch.tensor(0.0, dtype=torch.float64)
    tally.add_routing(0, zero, zero, torch.tensor([3, 1]), torch.tensor([1, 2, 1]))
    tally.add_routing(1, zero, zero, torch.tensor([4, 4]), torch.tensor([0, 0, 4]))
    # the entropy is the mean over the gate calls its hooks saw: 4 here (a global balance loss's
    # counting forwards call the gates too), not over the 2 routings counted
    record = tally.finish((torch.tensor(6.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)))
    assert record["router_entropy"] == 1.5
    assert record["active_experts_layers"] == [1.0, 2.0]
    assert record["active_experts_mean"] == 1.5 and record["active_experts_hist"] == [1, 2, 5]
    assert record["max_vio_layers"] == [0.5, 0.0]  # 3 / mean 2 - 1; balanced


def test_a_fresh_start_begins_a_new_config_record(tmp_path):
    path, cfg, mcfg = tmp_path / "m.config.json", TrainConfig.flat(steps=2), preset("tiny")
    record_config(path, cfg, mcfg, start=0, world_size=1)
    record_config(path, cfg, mcfg, start=0, world_size=1)  # the same folder, started afresh
    assert [i["started_at_step"] for i in json.loads(path.read_text())["invocations"]] == [0]
    record_config(path, cfg, mcfg, start=1, world_size=2)  # a resume adds its own
    invocations = json.loads(path.read_text())["invocations"]
    assert [(i["started_at_step"], i["world_size"]) for i in invocations] == [(0, 1), (1, 2)]


def step_record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.5,
        "aux_loss": 0.0,
        "lr": 1e-3,
        "dropped_fraction": 0.0,
        "tokens_per_s": 100.0,
        "peak_memory_mib": 10.0,
    }


def report(tmp_path, start: int, **flags) -> RunReport:
    cfg = TrainConfig.flat(metrics_jsonl=str(tmp_path / "m.jsonl"), progress=False, wandb_mode="disabled", **flags)
    return RunReport(cfg, preset("tiny"), DistInfo(0, 1, 0, torch.device("cpu")), start, None)


def test_a_resume_at_step_1_keeps_step_1_of_the_metrics(tmp_path):
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(step_record(s)) + "\n" for s in (1, 2, 3)))
    report(tmp_path, start=1, steps=3).bar.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [1]


def test_the_last_step_is_logged_off_the_log_every_grid(tmp_path, capsys):
    """steps 3, log_every 2: a line at step 2 and at the last step, 3; none at step 1."""
    run = report(tmp_path, start=0, steps=3, log_every=2)
    for step in (1, 2, 3):
        run.step(step_record(step))
    run.bar.close()
    logged = [line.split("|")[0].split() for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert logged == [["step", "2"], ["step", "3"]]


def test_wandb_opens_in_the_checkpoint_folder_unasked_and_not_without_a_folder(tmp_path, monkeypatch):
    """Unasked, without an API key, a run with a checkpoint folder gets an offline wandb run
    written there; a run with no folder of its own gets none (wandb.init replaced: no files).
    Without wandb installed, the error names what asked for it: $WANDB_MODE or --wandb-mode."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    opened = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: opened.append(kwargs) or "run")
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    assert init_wandb(TrainConfig.flat(progress=False), preset("tiny"), info) is None and opened == []
    folder = tmp_path / "ck"
    assert init_wandb(TrainConfig.flat(checkpoint_dir=str(folder), progress=False), preset("tiny"), info) == "run"
    assert [(o["dir"], o["mode"]) for o in opened] == [(str(folder), "offline")] and folder.is_dir()
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: the error names who asked for it
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ModuleNotFoundError, match=r"^\$WANDB_MODE offline needs wandb, which is not installed"):
        init_wandb(TrainConfig.flat(checkpoint_dir=str(folder), progress=False), preset("tiny"), info)
    with pytest.raises(ModuleNotFoundError, match="^--wandb-mode online needs wandb"):
        init_wandb(TrainConfig.flat(wandb_mode="online", progress=False), preset("tiny"), info)


def test_log_every_0_prints_no_line_but_warnings_still(tmp_path, capsys):
    """log_every 0 = never: no banner, no step line, the last step's included; a warning is printed
    (on stderr) whatever log_every says."""
    run = report(tmp_path, start=0, steps=2, log_every=0)
    run.say("a line")
    for step in (1, 2):
        run.step(step_record(step))
    run.warn("disk nearly full")
    run.bar.close()
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "warning: disk nearly full"


def test_config_boundaries():
    """The tiny preset covers 128 positions; a causal stride may equal seq_len; a burst length
    must be 0 or >= 1."""
    TrainConfig.flat(preset="tiny", seq_len=128, causal_stride=128, loss_burst=1.0)
    with pytest.raises(ValueError, match="seq_len=129 exceeds the tiny preset's max_seq_len=128"):
        TrainConfig.flat(preset="tiny", seq_len=129)
    with pytest.raises(ValueError, match="causal_stride=17 exceeds seq_len=16"):
        TrainConfig.flat(seq_len=16, causal_stride=17)
    with pytest.raises(ValueError, match="loss_burst must be 0"):
        TrainConfig.flat(loss_burst=0.9)


def test_token_id_equal_to_the_vocabulary_size_is_refused():
    corpus = Corpus(torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), 8, "eight")
    check_vocabulary(corpus, torch.tensor([0, 7]), where="a batch")
    with pytest.raises(ValueError, match="holds token id 8, outside its vocabulary of 8"):
        check_vocabulary(corpus, torch.tensor([0, 8]), where="a batch")


def test_a_part_of_exactly_seq_len_tokens_is_refused(monkeypatch):
    """A window reads seq_len + 1 tokens: a validation part of 16 tokens is too short at seq_len 16."""
    parts = {}
    monkeypatch.setattr("moe.training.batches.load_corpus", lambda *_: Corpus(parts["train"], parts["val"], 8, "x"))
    cfg = DataConfig(data="canary", seq_len=16, batch_size=2)
    parts.update(train=torch.zeros(40, dtype=torch.uint8), val=torch.zeros(17, dtype=torch.uint8))
    cfg.load()
    parts.update(val=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="has 16 val tokens, fewer than one window of seq_len \\+ 1 = 17"):
        cfg.load()
