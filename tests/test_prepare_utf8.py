"""Text that is not UTF-8 in ``python -m moe.data prepare`` (issue 60, item 6): each such byte is
replaced by U+FFFD as before, but now counted per file, said in one line and recorded in the
manifest (``not_utf8``); ``--encoding-errors strict`` refuses it in one line, naming the file."""

import json
from pathlib import Path

import numpy as np
import pytest
from extras import need

need("tokenizers", "data")

from moe.data.__main__ import main  # noqa: E402
from moe.data.documents import PIECE_BYTES, NotUTF8, read_pieces  # noqa: E402
from moe.data.tokenizer import load_tokenizer_file  # noqa: E402

TEXT = {"a.txt": b"caf\xc3\xa9 \xff\xfe ok\n\xe9t\xe9\n", "b.txt": b"clean text\n", "c.jsonl": b'{"text": "x\xffy"}\n'}
"""Bytes of three files: a.txt has 4 bytes that are not UTF-8, c.jsonl 1, b.txt none."""


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name, data in TEXT.items():
        (folder / name).write_bytes(data)
    return folder


def prepare(corpus: Path, out: Path, *extra: str) -> int:
    return main(["prepare", str(corpus), "--out", str(out), "--bytes", "--no-progress", *extra])


def test_bytes_that_are_not_utf8_are_counted_said_and_recorded(corpus, tmp_path, capsys):
    assert prepare(corpus, tmp_path / "out") == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning == [
        "warning: 5 bytes that are not UTF-8 in 2 files were replaced by U+FFFD (a.txt: 4, c.jsonl: 1); "
        "recorded in the manifest (not_utf8); --encoding-errors strict refuses them"
    ], warning
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["not_utf8"] == {"replaced_bytes": 5, "files": {"a.txt": 4, "c.jsonl": 1}}
    # the tokens are those of the text with each such byte replaced, read back by the tokenizer
    ids = np.fromfile(tmp_path / "out" / "shard-00000.bin", dtype="<u2").tolist()
    text = load_tokenizer_file(str(tmp_path / "out" / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    docs = [TEXT["a.txt"], TEXT["b.txt"], b"x\xffy"]
    assert text == "".join(d.decode("utf-8", errors="replace") + manifest["eot_token"] for d in docs)


def test_strict_refuses_in_one_line_naming_the_file_and_leaves_nothing(corpus, tmp_path, capsys):
    assert prepare(corpus, tmp_path / "out", "--encoding-errors", "strict") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{corpus / 'a.txt'}: the text is not UTF-8 (4 bytes" in err, err
    assert not (tmp_path / "out").exists()


def test_utf8_text_records_nothing_replaced(corpus, tmp_path, capsys):
    assert prepare(corpus / "b.txt", tmp_path / "out", "--encoding-errors", "strict") == 0
    assert "warning" not in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["not_utf8"] == {"replaced_bytes": 0, "files": {}}


def test_the_warning_names_five_files_without_an_and_0_more():
    said = NotUTF8()
    said.files = {f"f{i}.txt": i + 1 for i in range(5)}
    assert said.said() == (
        "warning: 15 bytes that are not UTF-8 in 5 files were replaced by U+FFFD (f0.txt: 1, f1.txt: 2, f2.txt: 3, "
        "f3.txt: 4, f4.txt: 5); recorded in the manifest (not_utf8); --encoding-errors strict refuses them"
    )
    said.files["f5.txt"] = 6
    assert "f4.txt: 5 and 1 more); recorded" in said.said()


def test_bytes_not_utf8_are_counted_over_every_piece_of_a_file(tmp_path):
    """100,000 bytes, one in five 0xFF: the file is read in two pieces, its count is the 20,000
    of both."""
    f = tmp_path / "big.txt"
    f.write_bytes(b"\xffabc\n" * 20_000)
    assert f.stat().st_size > PIECE_BYTES
    not_utf8 = NotUTF8()
    pieces = list(read_pieces([f], not_utf8=not_utf8))
    assert len(pieces) == 2 and not_utf8.files == {str(f): 20_000}
