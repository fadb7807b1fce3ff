"""Training and sampling from a prepared directory: the vocabulary from the manifest, exact
resume in the middle of the shards, one process = two processes, the Hugging Face path,
``experiments/generate.py`` and the leakage study printing text decoded by the tokenizer."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from extras import need
from helpers import HF_RUN, ROOT, SUBPROCESS_ENV, train_on_two_processes

need("tokenizers", "data")

from prepared import prepare, write_texts  # noqa: E402

import moe.training.loop as mt  # noqa: E402
from moe.data import batch_offsets, load_corpus  # noqa: E402
from moe.data.shards import read_manifest  # noqa: E402
from moe.training import TrainConfig, config_from_args, train  # noqa: E402

SMALL = dict(
    seq_len=32,
    batch_size=8,
    eval_windows=4,
    eval_batch_size=4,
    causal_stride=8,
    warmup_steps=2,
    log_every=0,
    progress=False,
    model={"d_model": 32, "moe_d_ff": 64},
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """A prepared directory: a BPE of 300 tokens, shards of 5,000 tokens."""
    tmp = tmp_path_factory.mktemp("data")
    write_texts(tmp / "texts", num_files=3, lines=900)
    assert prepare(tmp / "texts", "--out", tmp / "out", "--train-tokenizer", 300, "--shard-tokens", 5000) == 0
    return str(tmp / "out")


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_model_takes_its_vocabulary_from_the_manifest_and_learns(data):
    vocab = read_manifest(data)["vocab_size"]
    res = train(TrainConfig.flat(data=data, steps=30, lr=1e-2, **SMALL))
    assert res.model_config.vocab_size == vocab and res.model.embed.weight.shape[0] == vocab
    losses = [r["loss"] for r in res.history]
    assert abs(losses[0] - math.log(vocab)) < 0.3, losses[0]  # random init: uniform over the vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_resume_continues_at_exactly_the_next_batch_mid_shard(data, tmp_path, monkeypatch):
    common = dict(data=data, steps=6, eval_every=3, **SMALL)
    full = train(TrainConfig.flat(metrics_jsonl=str(tmp_path / "full.jsonl"), **common))
    real_batch, seen = mt.local_batch, {}

    def crash_at_step_5(corpus, cfg, seed, step, device, data_parallel=(0, 1)):
        if step == 5:
            raise RuntimeError("simulated crash")
        seen[step] = real_batch(corpus, cfg, seed, step, device, data_parallel)
        return seen[step]

    monkeypatch.setattr(mt, "local_batch", crash_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(
            TrainConfig.flat(
                checkpoint_dir=str(tmp_path / "run"),
                checkpoint_every=3,
                metrics_jsonl=str(tmp_path / "resumed.jsonl"),
                **common,
            )
        )
    monkeypatch.setattr(mt, "local_batch", real_batch)
    resumed = train(
        TrainConfig.flat(
            checkpoint_dir=str(tmp_path / "run"),
            checkpoint_every=3,
            resume=True,
            metrics_jsonl=str(tmp_path / "resumed.jsonl"),
            **common,
        )
    )
    keys = ("step", "loss", "aux_loss", "grad_norm", "eval/causal_loss")
    a = [[r.get(k) for k in keys] for r in read_jsonl(tmp_path / "full.jsonl")]
    b = [[r.get(k) for k in keys] for r in read_jsonl(tmp_path / "resumed.jsonl")]
    assert a == b and len(b) == 6, (a, b)  # bitwise: the same batches in the same order
    weights = zip(full.model.state_dict().values(), resumed.model.state_dict().values())
    assert all(torch.equal(pa, pb) for pa, pb in weights)
    # Batches are drawn from (seed, step) with no reader state to restore: the first batch after
    # the checkpoint of step 3 starts in the middle of several shards, as the uninterrupted run's.
    assert set(seen) == {1, 2, 3, 4}
    train_view = load_corpus(data).train
    offsets = batch_offsets(train_view.numel(), common["seq_len"], common["batch_size"], 0, 4).numpy()
    piece = np.searchsorted(train_view.ends, offsets, side="right")
    in_shard = [train_view.pieces[p][1] + o - train_view.starts[p] for p, o in zip(piece, offsets)]
    shards = {id(train_view.pieces[p][0]) for p in piece}
    assert len(shards) >= 2 and min(in_shard) > 0, (shards, in_shard)


@pytest.mark.slow
def test_one_process_and_two_processes_give_the_same_losses(data, tmp_path):
    args = [
        "--data",
        data,
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--eval-windows",
        "2",
        "--causal-stride",
        "8",
        "--log-every",
        "0",
        "--no-progress",
        "--d-model",
        "32",
        "--moe-d-ff",
        "64",
    ]
    train(config_from_args([*args, "--metrics-jsonl", str(tmp_path / "s.jsonl")]))
    train_on_two_processes([*args, "--metrics-jsonl", str(tmp_path / "d.jsonl")], timeout_s=180)
    s, d = read_jsonl(tmp_path / "s.jsonl"), read_jsonl(tmp_path / "d.jsonl")
    assert len(s) == len(d) == 4
    for rs, rd in zip(s, d):
        assert abs(rs["loss"] - rd["loss"]) < 1e-5, (rs["step"], rs["loss"], rd["loss"])
        assert rs["tokens_per_expert"] == rd["tokens_per_expert"]
    assert abs(s[-1]["eval/causal_loss"] - d[-1]["eval/causal_loss"]) < 1e-5


def test_hf_model_trains_from_a_prepared_directory(data):
    need("transformers", "hf")
    vocab = read_manifest(data)["vocab_size"]
    res = train(TrainConfig.flat(data=data, hf_model="olmoe-tiny", router="ec_threshold", steps=20, **HF_RUN))
    assert res.model.hf.config.vocab_size == vocab
    losses = [r["loss"] for r in res.history]
    assert abs(losses[0] - math.log(vocab)) < 0.3, losses[0]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert abs(res.final_eval["leakage_gap"]) < 1e-5


def test_generate_prints_text_decoded_by_the_tokenizer(data, tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import generate
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    train(TrainConfig.flat(data=data, steps=2, checkpoint_dir=str(tmp_path), export_model=True, **SMALL))
    prompt = "the quick brown"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "generate.py"),
            str(tmp_path / "model.pt"),
            "--data",
            data,
            "--prompt",
            prompt,
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
        ],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpus = load_corpus(data)
    model = generate.load_export(str(tmp_path / "model.pt"))
    ids = torch.tensor([corpus.encode(prompt)])
    new = model.generate(ids, 12, temperature=0)[0, ids.shape[1] :]
    want = (
        f"--- prompt: {ids.shape[1]} tokens given ---\n{prompt}\n--- sample: 12 new tokens ---\n{corpus.decode(new)}\n"
    )
    assert proc.stdout == want and corpus.decode(new)
    wrong = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "generate.py"), str(tmp_path / "model.pt")],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2 and "pass the --data it was trained on" in wrong.stderr


@pytest.mark.slow
def test_leakage_study_on_a_prepared_directory_prints_decoded_samples(data, tmp_path):
    out = tmp_path / "gap.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "leakage_gap.py"),
            "--quick",
            "--corpora",
            "text",
            "--data",
            data,
            "--routers",
            "topk",
            "--text-steps",
            "3",
            "--workers",
            "1",
            "--json",
            str(out),
        ],
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["router"]: r for r in json.loads(out.read_text())["routers"]}
    corpus = load_corpus(data)
    prompt = corpus.decode(corpus.val[torch.arange(32)])
    for router, row in rows.items():
        assert row["sample"].startswith(prompt) and len(row["sample"]) > len(prompt), row["sample"]
        assert f"{router} sample: {row['sample']!r}" in proc.stdout
