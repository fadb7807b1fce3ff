"""Corpus loading: default stdlib corpus, canary, user paths, deterministic split, batches."""

import sysconfig
import zlib
from pathlib import Path

import pytest
import torch

from moe.data import batch_offsets, canary_tokens, eval_offsets, load_corpus, split, stdlib_files, windows


def test_split_hand_worked_and_spread():
    # 25 tokens, val_fraction 0.25: 6 validation tokens, one at the end of each of 6 segments
    # (segment ends 4, 8, 12, 16, 20, 25).
    train, val = split(torch.arange(25), 0.25)
    assert val.tolist() == [3, 7, 11, 15, 19, 24]
    assert train.tolist() == [i for i in range(25) if i not in (3, 7, 11, 15, 19, 24)]
    train, val = split(torch.arange(100_000), 0.1)
    assert val.numel() == 10_000 and train.numel() == 90_000
    assert torch.equal(torch.sort(torch.cat([train, val])).values, torch.arange(100_000))
    # Validation samples the whole stream: some in every twentieth of it.
    assert torch.bincount(val // 5_000, minlength=20).min() == 500


def test_stdlib_corpus_is_deterministic_real_source():
    files = stdlib_files()
    assert files, "the running interpreter ships its standard library sources"
    root = Path(sysconfig.get_paths()["stdlib"])
    order = sorted(files, key=lambda f: zlib.crc32(f.relative_to(root).as_posix().encode()))
    raw = b""
    for f in order:
        raw += f.read_bytes() + b"\n"
        if len(raw) >= 200_000:
            break
    tokens = torch.frombuffer(bytearray(raw[:200_000]), dtype=torch.uint8)
    train_idx, val_idx = split(torch.arange(200_000), 0.1)
    a = load_corpus("stdlib", val_fraction=0.1, max_bytes=200_000)
    assert torch.equal(a.train, tokens[train_idx]) and torch.equal(a.val, tokens[val_idx])
    assert a.vocab_size == 256 and a.val.numel() == 20_000
    assert b"import " in raw and b"def " in raw  # real Python source
    assert not any("site-packages" in f.parts for f in files)


def test_user_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / ".hidden").write_text("never read")
    c = load_corpus(str(tmp_path), val_fraction=0.25)
    stream = b"first file\n\nsecond file\n\n"  # sorted, newline-joined, hidden files skipped
    train_idx, val_idx = split(torch.arange(len(stream)), 0.25)
    assert bytes(c.train.tolist()) == bytes(stream[i] for i in train_idx.tolist())
    assert bytes(c.val.tolist()) == bytes(stream[i] for i in val_idx.tolist())
    f = load_corpus(str(tmp_path / "b.txt"), val_fraction=0.5)
    assert sorted(torch.cat([f.train, f.val]).tolist()) == sorted(b"second file\n\n")


def test_missing_and_empty_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        load_corpus(str(tmp_path / "empty_dir"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="val_fraction"):
        split(torch.zeros(10, dtype=torch.uint8), 1.5)


def test_canary_is_uniform_and_fixed():
    t = canary_tokens(8, 80_000)
    assert torch.equal(t, canary_tokens(8, 80_000))
    freq = torch.bincount(t.long(), minlength=8).double() / t.numel()
    assert (freq - 1 / 8).abs().max() < 0.01, freq
    c = load_corpus("canary", max_bytes=10_000, canary_vocab=8)
    assert c.vocab_size == 8 and int(c.train.max()) < 8 and c.val.numel() == 1_000


def test_batches_are_a_function_of_seed_and_step():
    tokens = torch.arange(100, dtype=torch.uint8)
    o1 = batch_offsets(100, 8, 4, seed=3, step=7)
    assert torch.equal(o1, batch_offsets(100, 8, 4, seed=3, step=7))
    assert not torch.equal(o1, batch_offsets(100, 8, 4, seed=3, step=8))
    idx, tgt = windows(tokens, o1, 8)
    for b, o in enumerate(o1.tolist()):
        assert idx[b].tolist() == list(range(o, o + 8)) and tgt[b].tolist() == list(range(o + 1, o + 9))
    assert eval_offsets(100, 8, 4).tolist() == [0, 24, 48, 72]
    with pytest.raises(ValueError, match="non-overlapping windows"):
        eval_offsets(100, 8, 50)


def test_byte_and_canary_corpora_decode_and_encode():
    text = "déjà vu: def f(x):\n"
    c = load_corpus("stdlib", max_bytes=10_000)
    assert c.encode(text) == list(text.encode()) and c.decode(c.encode(text)) == text
    assert c.decode([0xE2, 0x82]) == "\ufffd"  # a cut UTF-8 sequence is replaced, never raised
    canary = load_corpus("canary", max_bytes=1_000, canary_vocab=8)
    assert canary.decode(torch.tensor([3, 0, 7])) == "3 0 7"
    with pytest.raises(ValueError, match="no text encoding"):
        canary.encode("abc")
