"""Prepared directories read through memory maps: the views hold what the stream holds, split
by the byte corpora's rule whatever the shard cuts, each data-parallel rank reads only its own
rows, and the process's memory does not grow with the token count."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SOURCE_PATH

from moe.data import (
    Corpus,
    TokenShards,
    batch_offsets,
    eval_offsets,
    load_corpus,
    load_prepared,
    split,
    windows,
)
from moe.data.shards import FORMAT
from moe.training.batches import DataConfig, local_batch

ROOT = Path(__file__).resolve().parents[1]


def write_shards(directory: Path, tokens: np.ndarray, cuts: list[int], vocab_size: int, dtype: str) -> None:
    """A prepared directory written by hand (no tokenizer): ``tokens`` cut at ``cuts``."""
    directory.mkdir(parents=True)
    shards = []
    for k, part in enumerate(np.split(tokens, cuts)):
        name = f"s{k}.bin"
        part.astype("<u2" if dtype == "uint16" else "<u4").tofile(directory / name)
        shards.append({"file": name, "num_tokens": int(part.size)})
    manifest = {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "shards": shards,
        "num_tokens": int(tokens.size),
        "tokenizer": "tokenizer.json",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype,vocab", [("uint16", 65_535), ("uint32", 100_000)])
def test_views_hold_the_stream_split_by_the_byte_corpus_rule(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, 5_000)
    write_shards(tmp_path / "d", tokens, [1, 1_234, 1_300, 4_000], vocab, dtype)
    corpus = load_corpus(str(tmp_path / "d"), val_fraction=0.1, max_bytes=100)  # max_bytes: byte corpora only
    assert corpus.vocab_size == vocab and corpus.tokenizer is None
    train_ref, val_ref = split(torch.from_numpy(tokens), 0.1)
    assert corpus.train.numel() == train_ref.numel() and corpus.val.numel() == val_ref.numel() == 500
    assert torch.equal(corpus.train[torch.arange(train_ref.numel())], train_ref)
    assert torch.equal(corpus.val[:], val_ref) and torch.equal(corpus.train[10:1_300:7], train_ref[10:1_300:7])
    for step in range(5):  # training windows, also across shard and segment boundaries
        offsets_B = batch_offsets(corpus.train.numel(), 64, 16, seed=1, step=step)
        for got, want in zip(windows(corpus.train, offsets_B, 64), windows(train_ref, offsets_B, 64)):
            assert torch.equal(got, want), step
    idx_WT, tgt_WT = windows(corpus.val, eval_offsets(500, 32, 8), 32)
    assert torch.equal(idx_WT, windows(val_ref, eval_offsets(500, 32, 8), 32)[0]) and tgt_WT.dtype == torch.long
    with pytest.raises(IndexError, match="out of range"):
        corpus.val[torch.tensor([500])]


def test_split_does_not_depend_on_the_shard_cuts(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 300, 7_777)
    write_shards(tmp_path / "one", tokens, [], 300, "uint16")
    write_shards(tmp_path / "many", tokens, list(range(100, 7_700, 100)), 300, "uint16")
    a, b = load_prepared(tmp_path / "one", 0.05), load_prepared(tmp_path / "many", 0.05)
    assert len(b.train.pieces) > 70 and len(a.train.pieces) == 20  # 20 segments, each ends in validation
    for part in ("train", "val"):
        n = getattr(a, part).numel()
        assert torch.equal(getattr(a, part)[:], getattr(b, part)[:]) and n == getattr(b, part).numel()


def test_a_damaged_directory_is_refused(tmp_path):
    write_shards(tmp_path / "d", np.arange(100), [50], 300, "uint16")
    (tmp_path / "d" / "s1.bin").write_bytes(b"\0" * 99)
    with pytest.raises(ValueError, match="s1.bin.* holds 99 bytes, the manifest says 50 tokens"):
        load_prepared(tmp_path / "d", 0.1)
    (tmp_path / "d" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="is not a moe.data.shards manifest"):
        load_prepared(tmp_path / "d", 0.1)


class CountingShards(TokenShards):
    """Records every position it is asked for."""

    def __init__(self, inner: TokenShards) -> None:
        super().__init__(inner.pieces)
        self.read: list[int] = []

    def __getitem__(self, idx):
        self.read += idx.reshape(-1).tolist()
        return super().__getitem__(idx)


def test_each_data_parallel_rank_reads_only_its_own_rows(tmp_path):
    write_shards(tmp_path / "d", np.random.default_rng(2).integers(0, 300, 20_000), [7_000, 13_000], 300, "uint16")
    base = load_prepared(tmp_path / "d", 0.1)
    cfg, cpu = DataConfig(seq_len=16, batch_size=8), torch.device("cpu")
    full_BT, _ = local_batch(base, cfg, 3, 5, cpu, (0, 1))
    offsets_B = batch_offsets(base.train.numel(), 16, 8, seed=3, step=5)
    for rank in range(4):
        counted = CountingShards(base.train)
        idx_bT, _ = local_batch(Corpus(counted, base.val, 300, "counted"), cfg, 3, 5, cpu, (rank, 4))
        mine = offsets_B[rank * 2 : rank * 2 + 2]
        assert sorted(counted.read) == sorted((mine[:, None] + torch.arange(17)).reshape(-1).tolist()), rank
        assert torch.equal(idx_bT, full_BT[rank * 2 : rank * 2 + 2]), rank


RSS_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    from moe.data import batch_offsets, eval_offsets, load_corpus, windows
    corpus = load_corpus(sys.argv[1], 0.1)
    for step in range(1, 41):
        windows(corpus.train, batch_offsets(corpus.train.numel(), 256, 32, 0, step), 256)
    windows(corpus.val, eval_offsets(corpus.val.numel(), 256, 64), 256)
    corpus.train[-1000:]
    print(corpus.train.numel() + corpus.val.numel(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
""")


def peak_rss(directory: Path, num_tokens: int, shards: int) -> tuple[int, int]:
    """(tokens, peak RSS in MiB) of a process loading a prepared directory of ``num_tokens``
    zero ids (sparse files: nothing on disk) and drawing 40 batches and the evaluation windows."""
    directory.mkdir()
    per = num_tokens // shards
    for k in range(shards):
        with (directory / f"s{k}.bin").open("wb") as f:
            f.truncate(per * 2)
    manifest = {
        "format": FORMAT,
        "vocab_size": 50_000,
        "dtype": "uint16",
        "num_tokens": per * shards,
        "shards": [{"file": f"s{k}.bin", "num_tokens": per} for k in range(shards)],
        "tokenizer": "none",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_memory_does_not_grow_with_the_token_count(tmp_path):
    small_n, small_mib = peak_rss(tmp_path / "small", 1_000_000, 2)
    big_n, big_mib = peak_rss(tmp_path / "big", 300_000_000, 3)  # 600 MB of uint16 ids if read whole
    assert big_n == 300_000_000 and small_n == 1_000_000
    assert big_mib - small_mib < 48, (small_mib, big_mib)
