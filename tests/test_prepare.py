"""``python -m moe.data prepare``: the tokens written are the input's documents (decoded back
to the very text), the same for any number of workers and any shard size; text folders,
.jsonl, .parquet, a trained BPE, a tokenizer.json and a Hugging Face tokenizer folder; bad
input is one line and exit 2 with nothing left that looks complete."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from extras import need

need("tokenizers", "data")

from prepared import LINKED, decoded, prepare, sentences, stream, write_linked_folder, write_texts  # noqa: E402

import moe.data.documents as documents_module  # noqa: E402
import moe.data.prepare as prepare_module  # noqa: E402
from moe.data.shards import read_manifest  # noqa: E402
from moe.data.tokenizer import load_tokenizer_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(input folder, its documents, a prepared directory with a BPE of 300 trained on it)."""
    tmp = tmp_path_factory.mktemp("prepared")
    docs = write_texts(tmp / "texts")
    assert prepare(tmp / "texts", "--out", tmp / "out", "--train-tokenizer", 300, "--shard-tokens", 1000) == 0
    return tmp / "texts", docs, tmp / "out"


def test_trained_bpe_shards_decode_to_the_input_documents(trained):
    _, docs, out = trained
    m = read_manifest(out)
    assert m["dtype"] == "uint16" and m["byte_order"] == "little" and m["eot_id"] == 0
    assert 257 < m["vocab_size"] <= 300 and m["num_documents"] == 3
    assert [s["num_tokens"] for s in m["shards"][:-1]] == [1000] * (len(m["shards"]) - 1)
    assert sum(s["num_tokens"] for s in m["shards"]) == m["num_tokens"] == stream(out).size
    assert (out / m["tokenizer"]).is_file() and sorted(p.name for p in out.iterdir() if p.suffix != ".bin") == [
        "manifest.json",
        "tokenizer.json",
    ]
    # Byte-level BPE is lossless: each document decodes to its file's text (sorted, hidden file skipped).
    assert decoded(out) == docs
    # Subwords: fewer tokens than bytes, every id below the vocabulary.
    assert stream(out).size < 0.8 * sum(len(d.encode()) for d in docs) and stream(out).max() < m["vocab_size"]


def test_a_folder_with_links_is_read_once_and_a_short_vocabulary_is_explained(tmp_path, capsys):
    texts = write_linked_folder(tmp_path)
    assert prepare(texts, "--out", tmp_path / "out", "--train-tokenizer", 8192) == 0
    said = capsys.readouterr().out
    m = read_manifest(tmp_path / "out")
    assert m["num_files"] == m["num_documents"] == len(LINKED["files"]), m
    assert {k: m["skipped"][k] for k in ("already_read", "broken_links", "empty")} == {
        k: LINKED[k] for k in ("already_read", "broken_links", "empty")
    }
    assert "read 3 files, skipped 5 links that point at a file or folder already read (0first.txt -> sub/b.txt" in said
    texts_read = [(texts / f).read_text() for f in LINKED["files"]]
    assert decoded(tmp_path / "out") == texts_read  # each file once, by its own path's order
    # fewer tokens than asked for, said with the reason, which holds: every word of the input is one token
    tok = load_tokenizer_file(str(tmp_path / "out" / "tokenizer.json"))
    assert m["vocab_size"] < 8192 and f"the tokenizer has {m['vocab_size']:,} tokens, not the 8,192 asked for" in said
    words = {w for text in texts_read for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)}
    assert [w for w in words if len(tok.model.tokenize(w)) != 1] == []


def test_a_vocabulary_of_the_size_asked_for_needs_no_word(trained, capsys):
    texts, _, _ = trained
    assert read_manifest(trained[2])["vocab_size"] == 300
    assert prepare(texts, "--out", trained[2].parent / "again", "--train-tokenizer", 300) == 0
    assert "asked for" not in capsys.readouterr().out


def test_the_same_tokens_for_any_workers_and_shard_size(trained, tmp_path, monkeypatch):
    texts, _, out = trained
    # Small pieces and batches: documents cross pieces, many batches are in flight in the workers.
    monkeypatch.setattr(documents_module, "PIECE_BYTES", 512)
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 2048)
    assert (
        prepare(
            texts,
            "--out",
            tmp_path / "w2",
            "--tokenizer",
            out / "tokenizer.json",
            "--workers",
            2,
            "--shard-tokens",
            10**9,
        )
        == 0
    )
    m = read_manifest(tmp_path / "w2")
    assert len(m["shards"]) == 1 and m["config"]["workers"] == 2
    assert np.array_equal(stream(tmp_path / "w2"), stream(out))


def test_jsonl_and_parquet_documents_with_a_tokenizer_file(trained, tmp_path):
    _, _, out = trained
    docs = [sentences(10 + i, 3 + i) for i in range(5)] + ["", "one line, no newline"]
    (tmp_path / "in").mkdir()
    with (tmp_path / "in" / "a.jsonl").open("w") as f:
        for d in docs[:4]:
            f.write(json.dumps({"id": 1, "body": d}) + "\n\n")  # blank lines are skipped
    pa = need("pyarrow", "data")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs[4:], "n": list(range(3))}), tmp_path / "in" / "b.parquet")
    assert (
        prepare(
            tmp_path / "in", "--out", tmp_path / "out", "--tokenizer", out / "tokenizer.json", "--text-field", "body"
        )
        == 0
    )
    assert decoded(tmp_path / "out") == docs


def test_hugging_face_tokenizer_folder_with_and_without_tokenizer_json(trained, tmp_path):
    transformers = need("transformers", "hf")
    texts, _, out = trained
    tok = load_tokenizer_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(["</s>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(tmp_path / "hf")
    assert prepare(texts, "--out", tmp_path / "a", "--tokenizer", tmp_path / "hf") == 0
    m = read_manifest(tmp_path / "a")
    eos = tok.token_to_id("</s>")
    assert m["eot_id"] == eos == m["vocab_size"] - 1 and m["eot_token"] == "</s>"  # the folder's eos_token
    a = stream(tmp_path / "a")
    assert np.array_equal(np.where(a == eos, 0, a), stream(out))  # same ids, another separator
    # GPT-2 style files only (vocab.json + merges.txt): transformers converts them to a fast tokenizer.
    (tmp_path / "gpt2").mkdir()
    tok.model.save(str(tmp_path / "gpt2"))
    (tmp_path / "gpt2" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "add_prefix_space": False})
    )
    assert prepare(texts, "--out", tmp_path / "b", "--tokenizer", tmp_path / "gpt2") == 0
    assert np.array_equal(stream(tmp_path / "b"), stream(out))


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "moe.data", "prepare", *map(str, args), "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_bad_input_is_one_line_and_exit_2_leaving_nothing(trained, tmp_path, capsys):
    texts, _, out = trained
    proc = run_cli(tmp_path / "missing", "--out", tmp_path / "o", "--train-tokenizer", 300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(proc.stderr.strip().splitlines()) == 1 and "does not exist" in proc.stderr, proc.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "bad_last.jsonl").write_text(json.dumps({"text": sentences(0, 200)}) + "\n{oops\n")
    cases = [
        ((tmp_path / "empty", "--train-tokenizer", 300), "holds no text files"),
        ((texts, "--train-tokenizer", 256), "at least 257"),
        ((texts, "--tokenizer", tmp_path / "bad.json"), "does not load"),
        ((texts, "--tokenizer", out / "tokenizer.json", "--eot", "<nope>"), "not in the tokenizer"),
        ((tmp_path / "bad_last.jsonl", "--tokenizer", out / "tokenizer.json"), "bad_last.jsonl:2: not a JSON line"),
    ]
    for args, message in cases:
        assert prepare(*args, "--out", tmp_path / "o") == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)
        assert not (tmp_path / "o").exists() and leftovers(tmp_path) == [], (args, leftovers(tmp_path))
    assert prepare(texts, "--out", tmp_path / "full", "--train-tokenizer", 300) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty_out").mkdir()  # an existing empty directory is fine
    assert prepare(texts, "--out", tmp_path / "empty_out", "--tokenizer", out / "tokenizer.json") == 0
    assert np.array_equal(stream(tmp_path / "empty_out"), stream(out))


def prepare_peak_rss(text_file: Path, out: Path, tokenizer: Path) -> int:
    """Peak RSS (MiB) of a process preparing ``text_file``."""
    script = (
        "import resource, sys\nfrom moe.data.__main__ import main\n"
        "assert main(sys.argv[1:]) == 0\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "prepare",
            str(text_file),
            "--out",
            str(out),
            "--tokenizer",
            str(tokenizer),
            "--no-progress",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.slow
def test_preparing_streams_memory_stays_flat_with_the_input_size(trained, tmp_path):
    # One document of 4 MB: encoded in one call it peaks 800 MB higher (measured with 16 MB pieces).
    _, _, out = trained
    block = sentences(0, 6000)  # about 270 kB
    (tmp_path / "small.txt").write_text(block * 2)
    (tmp_path / "big.txt").write_text(block * 16)
    small = prepare_peak_rss(tmp_path / "small.txt", tmp_path / "s", out / "tokenizer.json")
    big = prepare_peak_rss(tmp_path / "big.txt", tmp_path / "b", out / "tokenizer.json")
    assert big - small < 40, (small, big)
    assert read_manifest(tmp_path / "b")["num_tokens"] > 7 * read_manifest(tmp_path / "s")["num_tokens"]


def word_tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    """A word-level tokenizer.json of ``vocab`` (whitespace-split words, unknown words [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_a_vocabulary_above_65535_writes_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    words = word_tokenizer(tmp_path / "words.json", vocab)
    (tmp_path / "doc.txt").write_text("w69999 w3 w65534 w65535 nope")
    assert prepare(tmp_path / "doc.txt", "--out", tmp_path / "out", "--tokenizer", words) == 0
    m = read_manifest(tmp_path / "out")
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_002 and m["eot_id"] == 0
    assert stream(tmp_path / "out").tolist() == [70_001, 5, 65_536, 65_537, 1, 0]


def test_the_eot_asked_for_ends_the_documents_and_the_vocabulary_covers_the_largest_id(tmp_path):
    """--eot names a brought tokenizer's end-of-document token (not its <|endoftext|>); ids with a
    gap (0, 1, 2, 3, then 9): the vocabulary is 10, the largest id + 1, not the 5 tokens it lists."""
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "<doc>": 2, "a": 3, "z": 9}
    words = word_tokenizer(tmp_path / "words.json", vocab)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "1.txt").write_text("a z")
    (tmp_path / "in" / "2.txt").write_text("z")
    assert prepare(tmp_path / "in", "--out", tmp_path / "out", "--tokenizer", words, "--eot", "<doc>") == 0
    m = read_manifest(tmp_path / "out")
    assert (m["eot_token"], m["eot_id"], m["vocab_size"]) == ("<doc>", 2, 10)
    assert stream(tmp_path / "out").tolist() == [3, 9, 2, 9, 2]


def test_a_tokenizer_of_exactly_257_tokens_may_be_trained():
    """257 = 256 bytes + the end-of-document token: the smallest byte-level BPE, allowed."""
    prepare_module.PrepareConfig(input="in", out="out", train_tokenizer=257)
    with pytest.raises(ValueError, match="needs at least 257 tokens"):
        prepare_module.PrepareConfig(input="in", out="out", train_tokenizer=256)


def test_a_parquet_row_without_text_is_no_document(tmp_path):
    """A null in the text column is skipped, not read as the text "None" (bytes as tokens)."""
    pa = need("pyarrow", "data")
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": ["a b", None, "c"]}), tmp_path / "in" / "t.parquet")
    assert prepare(tmp_path / "in", "--out", tmp_path / "out", "--bytes") == 0
    assert decoded(tmp_path / "out") == ["a b", "c"]
