"""Edges of the data readers that the data tests leave open, each with its expected answer worked
out by hand: the largest vocabulary a shard dtype holds (65,536 for uint16), a shard file longer
than its manifest says, a view's position just past its end, the text test's 25% bound on a
sample whose length is not a multiple of 4, a file of one byte, the canary's smallest
vocabulary (2) and the smallest byte-level BPE (257 tokens)."""

from __future__ import annotations

import codecs
import json

import numpy as np
import pytest
import torch

from moe.data.byte_corpora import canary_tokens
from moe.data.files import MAX_UNDECODABLE, TEXT_SAMPLE_BYTES, is_text, not_text_because, select_files
from moe.data.shards import check_vocabulary_fits, load_prepared, read_manifest, token_dtype


def test_uint16_shards_hold_a_vocabulary_of_65536_and_no_more():
    """uint16 ids run 0..65535: 65,536 tokens fit, 65,537 do not."""
    check_vocabulary_fits(65_536, "uint16", "here")
    with pytest.raises(ValueError, match="vocab_size 65,537 does not fit uint16 shards"):
        check_vocabulary_fits(65_537, "uint16", "here")


@pytest.mark.parametrize("vocab", [2, 65_535, 65_536, 65_537, 70_002])
def test_prepare_writes_uint16_for_every_vocabulary_whose_ids_fit_16_bits(vocab):
    """The largest id is vocab - 1: 65,536 tokens still fit uint16 (twice the bytes in uint32)."""
    fits = vocab - 1 <= np.iinfo(np.uint16).max
    assert token_dtype(vocab) == ("uint16" if fits else "uint32")
    check_vocabulary_fits(vocab, token_dtype(vocab), "here")


def write_prepared(directory, tokens: list[int], manifest_tokens: int):
    """A prepared directory of one uint16 shard holding ``tokens``, whose manifest says ``manifest_tokens``."""
    directory.mkdir()
    np.asarray(tokens, dtype="<u2").tofile(directory / "s0.bin")
    manifest = {
        "format": "moe.data.shards",
        "vocab_size": 16,
        "dtype": "uint16",
        "shards": [{"file": "s0.bin", "num_tokens": manifest_tokens}],
        "num_tokens": manifest_tokens,
        "tokenizer": "tokenizer.json",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_a_shard_longer_than_its_manifest_is_refused(tmp_path):
    """10 tokens of 2 bytes = 20 bytes: a manifest of 10 reads, one of 9 (18 bytes) does not."""
    read_manifest(write_prepared(tmp_path / "exact", list(range(10)), 10))
    with pytest.raises(ValueError, match="holds 20 bytes, the manifest says 9 tokens of 2 bytes"):
        read_manifest(write_prepared(tmp_path / "longer", list(range(10)), 9))


def test_a_view_refuses_the_position_just_past_its_end(tmp_path):
    corpus = load_prepared(write_prepared(tmp_path / "d", [i % 16 for i in range(100)], 100), 0.1)
    n = corpus.train.numel()
    assert corpus.train[torch.tensor([n - 1])].shape == (1,)
    with pytest.raises(IndexError, match=f"token positions \\[0, {n}\\] out of range for a view of {n} tokens"):
        corpus.train[torch.tensor([0, n])]


def test_a_manifest_that_counts_more_tokens_than_its_shards_or_an_empty_shard_is_refused(tmp_path):
    """Shards of 10 tokens under a manifest total of 12; a shard of 0 tokens (0 bytes: prepare
    never writes one)."""
    d = write_prepared(tmp_path / "more", list(range(10)), 10)
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "num_tokens": 12}))
    with pytest.raises(ValueError, match="num_tokens=12 is not the sum over its shards"):
        read_manifest(d)
    with pytest.raises(ValueError, match="holds 0 bytes, the manifest says 0 tokens"):
        read_manifest(write_prepared(tmp_path / "empty", [], 0))


def test_a_view_refuses_a_negative_position(tmp_path):
    """Numpy would read -1 as the last element of a shard: a view names it out of range instead."""
    corpus = load_prepared(write_prepared(tmp_path / "d", [i % 16 for i in range(100)], 100), 0.1)
    with pytest.raises(IndexError, match="token positions \\[-1, 3\\] out of range"):
        corpus.val[torch.tensor([3, -1])]


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\xffabc", True),  # 1 of 4 bytes not UTF-8: exactly 25%
        (b"\xff\xffabcdef", True),  # 2 of 8
        (b"\xff\xffabc", False),  # 2 of 5: 40%
        (b"\xff\xffabcde", False),  # 2 of 7: 28.6%
    ],
)
def test_text_allows_at_most_a_quarter_of_the_bytes_not_utf8(tmp_path, data, text):
    (tmp_path / "f").write_bytes(data)
    assert is_text(tmp_path / "f") is text


@pytest.mark.parametrize("bom", [codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE])
def test_a_utf16_file_is_named_by_its_byte_order_mark_either_way(tmp_path, bom):
    encoding = "utf-16-le" if bom == codecs.BOM_UTF16_LE else "utf-16-be"
    (tmp_path / "f.txt").write_bytes(bom + "plain text".encode(encoding))
    assert "a UTF-16 or UTF-32 byte order mark" in not_text_because(tmp_path / "f.txt")


def test_include_globs_match_the_path_in_the_folder_and_another_tools_manifest_is_text(tmp_path):
    """``sub/*`` selects what is under sub (the glob sees the relative path, not the file name);
    a manifest.json of another format is a file like any other, its folder read."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "top.txt").write_text("top")
    (tmp_path / "sub" / "a.txt").write_text("a")
    (tmp_path / "sub" / "manifest.json").write_text(json.dumps({"format": "another.tool"}))
    assert [f.name for f in select_files(tmp_path, include=["sub/*"]).files] == ["a.txt", "manifest.json"]
    sel = select_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in sel.files] == ["sub/a.txt", "sub/manifest.json", "top.txt"]
    assert sel.prepared_dirs == []


def test_a_file_of_one_byte_is_read(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"x")
    (tmp_path / "none.txt").write_bytes(b"")
    sel = select_files(tmp_path)
    assert [f.name for f in sel.files] == ["one.txt"] and sel.empty == ["none.txt"]


def test_the_canary_needs_two_tokens():
    assert set(canary_tokens(2, 200).tolist()) == {0, 1}
    for vocab in (1, 257):
        with pytest.raises(ValueError, match="canary vocab_size must be in \\[2, 256\\]"):
            canary_tokens(vocab, 10)


def test_a_byte_level_bpe_needs_257_tokens():
    """256 bytes and the end-of-document token: 256 is one too few."""
    pytest.importorskip("tokenizers")
    from moe.data.tokenizer import train_bpe

    assert train_bpe(["ab ab ab"], 257).get_vocab_size() == 257
    with pytest.raises(ValueError, match="at least 257 \\(256 bytes \\+ <\\|endoftext\\|>\\), got 256"):
        train_bpe(["ab ab ab"], 256)


def test_a_character_cut_by_the_end_of_the_sample_is_not_undecodable(tmp_path):
    """A sample of TEXT_SAMPLE_BYTES bytes: a quarter of them invalid (the most a text may hold),
    the rest ASCII, the last three the start of a 4-byte character that the sample cuts. Those
    three are valid UTF-8 the sample ends inside, so the file is text; one more invalid byte is
    not."""
    n = TEXT_SAMPLE_BYTES
    cut = "\U0001f600".encode()[:3]
    bad = int(MAX_UNDECODABLE * n)
    sample = b"\xff" * bad + b"a" * (n - bad - 3) + cut
    (tmp_path / "t").write_bytes(sample + b"\x80rest of the character and more")
    assert is_text(tmp_path / "t")
    (tmp_path / "u").write_bytes(b"\xff" + sample[1:-4] + b"\xff" + cut)
    assert not is_text(tmp_path / "u")
