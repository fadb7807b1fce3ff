"""The training loop: loss falls, exact resume, causal evaluation, wandb modes, data parallel, CLI."""

import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, SMALL_RUN, SOURCE_PATH, train_on_two_processes

import moe.parallel.memory as memory
import moe.training.loop as mt
from moe.data import eval_offsets, load_corpus, windows
from moe.eval import evaluate
from moe.model import MoETransformer, preset
from moe.training import TrainConfig, build_model, config_from_args, lr_at, model_config, train
from moe.training.metrics import resolve_wandb_mode

SMALL = SMALL_RUN


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny shapes: threads only add synchronisation, and on a shared 2-core machine they thrash.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_short_run_loss_falls(tmp_path):
    cfg = TrainConfig.flat(steps=40, lr=1e-2, metrics_jsonl=str(tmp_path / "m.jsonl"), **SMALL)
    res = train(cfg)
    losses = [r["loss"] for r in res.history]
    assert abs(losses[0] - math.log(256)) < 0.3, losses[0]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    last = records[-1]
    for key in ("loss", "aux_loss", "tokens_per_s", "dropped_fraction", "router_entropy", "eval/causal_loss"):
        assert key in last, key
    assert len(last["expert_load"]) == 2 and abs(sum(last["expert_load"][0]) - 1) < 1e-9
    assert sum(last["tokens_per_expert"][0]) == 8 * 32 * 2  # top-2, dropless
    # the resident peak: at least the interpreter, torch and the model's AdamW state; not the machine
    state_mib = 4 * res.model.num_parameters() * 4 / 2**20
    assert state_mib < records[0]["peak_memory_mib"] <= last["peak_memory_mib"] < 8192, last["peak_memory_mib"]


class RecordingLibc:
    """glibc's mallopt as the trainer sees it: records each call, succeeds."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


def test_the_trainer_fixes_the_cpu_mmap_threshold_unless_the_user_chose_one(monkeypatch, capsys):
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert memory.glibc().mallopt  # the real lookup finds it
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "glibc", lambda: libc)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    train(TrainConfig.flat(steps=1, **SMALL))
    assert libc.calls == [(-3, 1 << 20)]  # M_MMAP_THRESHOLD (malloc.h), 1 MiB
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc read the user's own at startup
    train(TrainConfig.flat(steps=1, **SMALL))
    assert libc.calls == [(-3, 1 << 20)]
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    cpu = torch.device("cpu")
    assert memory.limit_cpu_malloc(cpu, 0) is None and memory.limit_cpu_malloc(torch.device("cuda"), 1024) is None
    assert libc.calls == [(-3, 1 << 20)]  # --cpu-mmap-threshold-kib 0 and CUDA leave malloc alone
    assert memory.limit_cpu_malloc(cpu, 64) is None and libc.calls[-1] == (-3, 64 * 1024)
    with pytest.raises(ValueError, match="cpu_mmap_threshold_kib must be >= 0"):
        TrainConfig.flat(cpu_mmap_threshold_kib=-1)
    libc.calls.clear()
    train(TrainConfig.flat(steps=1, cpu_malloc_keep=True, **SMALL))  # keeping replaces the threshold
    assert libc.calls == [(-3, 64 << 20), (-1, 1 << 30), (-2, 64 << 20)], libc.calls
    monkeypatch.setattr(memory, "glibc", lambda: None)  # another C library: a no-op, said once
    capsys.readouterr()
    train(TrainConfig.flat(steps=2, **{**SMALL, "log_every": 1}))
    assert capsys.readouterr().out.count("mmap threshold is left as it is") == 1


RESIDENT_AFTER_FREE = """
import sys, torch
from moe.parallel.memory import current_bytes, limit_cpu_malloc
cpu = torch.device("cpu")
assert limit_cpu_malloc(cpu, 1024, keep_freed=sys.argv[1] == "keep") is None
before = current_bytes(cpu)
x = torch.ones(8 << 20)  # 32 MiB, every page touched
del x
print((current_bytes(cpu) - before) / 2**20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keeping_freed_memory_keeps_it_resident_and_the_threshold_returns_it():
    """What the two CPU malloc settings do with a freed 32 MiB tensor, in fresh processes (the
    settings are the process's): the trainer's 1 MiB threshold returns it (the resident set
    follows the tensors), ``cpu_malloc_keep`` keeps it for the next step to reuse."""
    kept = {}
    for mode in ("threshold", "keep"):
        done = subprocess.run(
            [sys.executable, "-c", RESIDENT_AFTER_FREE, mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, "PYTHONPATH": SOURCE_PATH},
        )
        kept[mode] = float(done.stdout)
    assert kept["threshold"] < 4 and kept["keep"] > 28, kept


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    # ec_threshold keeps router state in buffers (EMA thresholds, pending statistics): resume must restore it too.
    common = dict(steps=6, router="ec_threshold", eval_every=3, **SMALL)
    full = train(TrainConfig.flat(metrics_jsonl=str(tmp_path / "full.jsonl"), **common))

    run_dir = tmp_path / "run"
    jsonl = str(tmp_path / "resumed.jsonl")
    real_batch = mt.local_batch

    def crash_at_step_5(corpus, cfg, seed, step, device, data_parallel=(0, 1)):
        if step == 5:
            raise RuntimeError("simulated crash")
        return real_batch(corpus, cfg, seed, step, device, data_parallel)

    monkeypatch.setattr(mt, "local_batch", crash_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(TrainConfig.flat(checkpoint_dir=str(run_dir), checkpoint_every=3, metrics_jsonl=jsonl, **common))
    monkeypatch.setattr(mt, "local_batch", real_batch)
    assert [r["step"] for r in read_jsonl(jsonl)] == [1, 2, 3, 4]
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-00000003"]  # no temporary directory left behind
    resumed = train(
        TrainConfig.flat(checkpoint_dir=str(run_dir), checkpoint_every=3, metrics_jsonl=jsonl, resume=True, **common)
    )

    a, b = read_jsonl(tmp_path / "full.jsonl"), read_jsonl(jsonl)
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        for key in ("loss", "aux_loss", "grad_norm", "eval/causal_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    for (name, pa), pb in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_resume_with_more_steps_keeps_the_schedule_the_run_started_with(tmp_path, capsys):
    """A 6-step run resumed with --steps 10 is one 10-step run of a 6-step schedule, bit for
    bit: warmup and cosine as they were, then the final rate (lr * min_lr_ratio) for steps 7-10."""
    common = dict(router="ec_threshold", eval_every=0, lr=1e-2, min_lr_ratio=0.1, **{**SMALL, "log_every": 1})
    one = train(TrainConfig.flat(steps=10, schedule_steps=6, metrics_jsonl=str(tmp_path / "one.jsonl"), **common))
    run, jsonl = str(tmp_path / "run"), str(tmp_path / "resumed.jsonl")
    train(TrainConfig.flat(steps=6, checkpoint_dir=run, metrics_jsonl=jsonl, **common))
    capsys.readouterr()
    resumed = train(TrainConfig.flat(steps=10, checkpoint_dir=run, metrics_jsonl=jsonl, resume=True, **common))
    said = capsys.readouterr().out.splitlines()
    line = "--steps 10 runs past the 6-step learning-rate schedule the run started with: kept, steps 7-10 at its final"
    assert any(ln.startswith(line) and "1.00e-03" in ln for ln in said), said
    a, b = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(jsonl)
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [r["lr"] for r in b[6:]] == [1e-2 * 0.1] * 4 and b[5]["lr"] == pytest.approx(1e-3)
    for ra, rb in zip(a, b):
        for key in ("lr", "loss", "aux_loss", "grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    for (name, pa), pb in zip(one.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    # asked for: --schedule-steps stretches the schedule to the new --steps, and says so
    capsys.readouterr()
    stretched = TrainConfig.flat(steps=14, schedule_steps=14, checkpoint_dir=run, resume=True, **common)
    history = train(stretched).history
    said = capsys.readouterr().out
    assert "--schedule-steps 14: the learning-rate schedule changes from the 6 steps the run started with to 14" in said
    assert history[0]["step"] == 11 and history[0]["lr"] == lr_at(10, stretched.optimizer) > 1e-3


def reference_causal_loss(model, val, cfg, stride):
    """One window and one prefix at a time, no batching."""
    seq_len = cfg.data.seq_len
    idx_WT, tgt_WT = windows(val, eval_offsets(val.numel(), seq_len, cfg.eval.eval_windows), seq_len)
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for w in range(idx_WT.shape[0]):
            for t in range(stride - 1, seq_len, stride):
                logits_V = model(idx_WT[w : w + 1, : t + 1]).logits[0, -1].double()
                total += F.cross_entropy(logits_V, tgt_WT[w, t]).item()
                n += 1
    return total / n


@pytest.mark.parametrize("router", ["topk", "ec_threshold", "capacity", "expert_choice"])
def test_causal_evaluation(router):
    cfg = TrainConfig.flat(router=router, **SMALL)
    corpus = load_corpus(cfg.data.data, cfg.data.val_fraction, cfg.data.max_bytes)
    model = build_model(model_config(cfg.model, 256), seed=0, device=torch.device("cpu"))
    ev = evaluate(model, corpus.val, cfg.data.seq_len, cfg.eval.eval_windows, causal_stride=4, batch_size=2)
    ref = reference_causal_loss(model, corpus.val, cfg, stride=4)
    assert abs(ev["causal_loss"] - ref) < 1e-5, (ev["causal_loss"], ref)
    assert ev["eval_positions"] == cfg.eval.eval_windows * cfg.data.seq_len // 4
    if router in ("topk", "ec_threshold"):  # causal routers: decoding sees what teacher forcing sees
        assert abs(ev["leakage_gap"]) < 1e-5, ev
    else:  # capacity depends on the prefix length; expert choice on the future
        assert abs(ev["leakage_gap"]) > 1e-4, ev


def test_wandb_disabled_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    train(TrainConfig.flat(steps=2, wandb_dir=str(tmp_path / "wb"), **SMALL))
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_writes_a_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_wandb_mode(None, str(tmp_path)) == "offline"  # no key: never online, never a prompt
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(TrainConfig.flat(steps=2, wandb_dir=str(tmp_path), **SMALL))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb")), list(tmp_path.rglob("*"))


def test_wandb_is_opt_in_without_a_run_folder_or_without_wandb(monkeypatch):
    """The mode asked for wins, then $WANDB_MODE; unasked, a run with no folder of its own and a
    machine without wandb get "disabled", else "online" only with an API key."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_wandb_mode(None, None) == "disabled"  # nothing written into the working directory
    assert resolve_wandb_mode("offline", None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert resolve_wandb_mode(None, "runs/a") == "online" and resolve_wandb_mode(None, None) == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode(None, None) == "offline" and resolve_wandb_mode("disabled", "runs/a") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert resolve_wandb_mode(None, "runs/a") == "disabled"


def test_data_parallel_two_processes_equals_single_process(tmp_path):
    # the Switch loss counts expert fractions over both ranks (share_router_statistics), so it matches too
    args = [
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--max-bytes",
        "100000",
        "--eval-windows",
        "2",
        "--causal-stride",
        "8",
        "--log-every",
        "2",
        "--d-model",
        "32",
        "--moe-d-ff",
        "64",
        "--router",
        "topk",
    ]
    train(config_from_args([*args, "--no-progress", "--metrics-jsonl", str(tmp_path / "s.jsonl")]))
    (out0, err0), (out1, err1) = train_on_two_processes(
        [*args, "--metrics-jsonl", str(tmp_path / "d.jsonl")], timeout_s=120
    )
    # the banner (rank 0 only) counts the whole model, not rank 0's shard, and names the mesh
    whole = MoETransformer(preset("tiny", d_model=32, moe_d_ff=64)).num_parameters()
    assert f"model: {whole:,} parameters" in out0 and "mesh dp_replicate=1 x dp_shard=2 x ep=1" in out0, out0
    assert "model:" not in out1, out1
    # rank 0's progress bar advances to the end (rank 1 shows none); no warning from our own mesh code
    assert "4/4 [" in err0 and "0/4 [" in err0 and "it/s" not in err1, err0[-2000:]
    assert "Warning" not in err0 + err1, (err0 + err1)[-3000:]
    s, d = read_jsonl(tmp_path / "s.jsonl"), read_jsonl(tmp_path / "d.jsonl")
    assert len(s) == len(d) == 4
    for rs, rd in zip(s, d):
        assert abs(rs["loss"] - rd["loss"]) < 1e-5, (rs["step"], rs["loss"], rd["loss"])
        assert abs(rs["aux_loss"] - rd["aux_loss"]) < 1e-6, (rs["step"], rs["aux_loss"], rd["aux_loss"])
        assert rs["tokens_per_expert"] == rd["tokens_per_expert"]
    assert abs(s[-1]["eval/causal_loss"] - d[-1]["eval/causal_loss"]) < 1e-5


def help_of(args: list[str]) -> str:
    """What ``experiments/train.py ARGS --help`` prints."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "train.py"), *args, "--help"],
        env={**os.environ, "PYTHONPATH": SOURCE_PATH, "COLUMNS": "100"},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())  # without tyro's boxes


def test_cli_flags_come_from_the_configs():
    cfg = config_from_args(
        [
            "--router",
            "capacity",
            "--router-option",
            "top_k=1",
            "--router-option",
            "capacity_factor=1.5",
            "--router-option",
            "priority=score",
            "--router-option",
            "normalize=false",
            "--d-model",
            "32",
            "--steps",
            "7",
            "--no-progress",
            "--metrics-jsonl",
            "m.jsonl",
        ]
    )
    assert cfg.model.router_options == {"top_k": 1, "capacity_factor": 1.5, "priority": "score", "normalize": False}
    assert cfg.model.given() == {"d_model": 32} and cfg.optimizer.steps == 7 and cfg.logging.progress is False
    assert cfg.logging.metrics_jsonl == "m.jsonl" and cfg.parallel.expert_parallel == 1
    assert cfg == TrainConfig.flat(
        router="capacity",
        router_options=cfg.model.router_options,
        model={"d_model": 32},
        steps=7,
        progress=False,
        metrics_jsonl="m.jsonl",
    )
    help_text = " ".join(help_of([]).split())
    assert "--causal-stride" in help_text and "--num-experts" in help_text and "every k-th" in help_text
    with pytest.raises(ValueError, match="KEY=VALUE"):
        config_from_args(["--router-option", "top_k"])
    with pytest.raises(ValueError, match="expert"):
        train(TrainConfig.flat(expert_parallel=2, **SMALL))
    with pytest.raises(ValueError, match="unknown model overrides"):
        TrainConfig.flat(model={"d_modle": 3})


def test_model_config_follows_the_preset_router_options_rule_and_refuses_a_useless_d_ff():
    # gpu100m's top_k belongs to its topk router: expert choice (no top_k option) starts from its defaults
    ec = model_config(TrainConfig.flat(preset="gpu100m", router="expert_choice").model, 256)
    assert ec.router_options == {}
    with torch.device("meta"):
        assert len(MoETransformer(ec).routers()) == 6
    topk = model_config(
        TrainConfig.flat(preset="gpu100m", router="topk", router_options={"gate": "sigmoid"}).model, 256
    )
    assert topk.router_options == {"top_k": 2, "gate": "sigmoid"}
    assert topk == preset("gpu100m", vocab_size=256, router="topk", router_options={"gate": "sigmoid"})
    with pytest.raises(ValueError, match="d_ff=64 has no effect: every block is an MoE block"):
        model_config(config_from_args(["--d-ff", "64"]).model, 256)
    assert model_config(config_from_args(["--d-ff", "64", "--moe-every", "2"]).model, 256).d_ff == 64
    help_text = " ".join(help_of([]).split())
    assert "unused when every block is an MoE block (moe_every=1, the default), whose width is moe_d_ff" in help_text


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig.flat(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg.optimizer) for s in range(100)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
