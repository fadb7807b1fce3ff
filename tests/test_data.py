"""Corpus loading: default stdlib corpus, canary, user paths, deterministic split, batches."""

import math

import pytest
import torch

from moe.data import batch_offsets, canary_tokens, eval_offsets, load_corpus, split, stdlib_files, windows


def test_stdlib_corpus_is_deterministic_and_split_at_the_end():
    a = load_corpus("stdlib", val_fraction=0.1, max_bytes=200_000)
    # Bypass the per-process cache: re-read the files and rebuild the split by hand.
    files = stdlib_files()
    assert files, "the running interpreter ships its standard library sources"
    raw = b"".join(f.read_bytes() + b"\n" for f in files[:200])[:200_000]
    assert len(raw) == 200_000
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = math.floor(200_000 * 0.1)
    assert torch.equal(a.train, tokens[:-n_val]) and torch.equal(a.val, tokens[-n_val:])
    assert a.vocab_size == 256 and a.val.numel() == 20_000
    assert b"import " in raw and b"def " in raw  # real Python source
    b = load_corpus("stdlib", val_fraction=0.1, max_bytes=200_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def test_user_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / ".hidden").write_text("never read")
    c = load_corpus(str(tmp_path), val_fraction=0.25)
    stream = bytes(torch.cat([c.train, c.val]).tolist())
    assert stream == b"first file\n\nsecond file\n\n", stream  # sorted, newline-joined, hidden skipped
    assert c.val.numel() == math.floor(len(stream) * 0.25)
    f = load_corpus(str(tmp_path / "b.txt"), val_fraction=0.5)
    assert bytes(torch.cat([f.train, f.val]).tolist()) == b"second file\n\n"


def test_missing_and_empty_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
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
