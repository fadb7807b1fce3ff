"""A text with lines longer than a piece (64 kB): one long line without a line end, a file
with lone CR line ends (old Mac files: no LF at all), a Chinese line with no spaces. ``prepare``
reads them in pieces of bounded size as it reads every other text (it read such a line whole:
1.35 GB peak RSS for a 4.4 MB line, 0.30 GB with its line ends), and the pieces join to the
very text: cut before a space between two words, where the byte-level pre-tokenizer splits
anyway (the same tokens as the line encoded whole), or between two characters, never inside
one."""

import pytest
from extras import need

need("tokenizers", "data")

from prepared import prepare, stream  # noqa: E402

import moe.data.documents as documents_module  # noqa: E402
from moe.data.documents import read_pieces  # noqa: E402
from moe.data.tokenizer import load_tokenizer_file, train_bpe  # noqa: E402

PIECE = 256
WORDS = "Experten leiten Tokens, 专家, الخبراء, विशेषज्ञ 👩🏽‍💻 route  the   tokens".split(" ")


def long_line(n: int) -> str:
    return " ".join(WORDS[(7 * i) % len(WORDS)] for i in range(n))


TEXTS = {
    "one_line.txt": long_line(400),  # no line end at all; double and triple spaces among the words
    "cr.txt": "\r".join(long_line(30) for _ in range(20)) + "\r",
    "zh.txt": "".join(
        "专家路由因果模型文本训练数据"[(5 * i) % 14] for i in range(3000)
    ),  # no space: cut between characters
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_a_long_line_is_read_in_pieces_that_join_to_its_text(tmp_path, monkeypatch, name):
    monkeypatch.setattr(documents_module, "PIECE_BYTES", PIECE)
    f = tmp_path / name
    f.write_bytes(TEXTS[name].encode())
    pieces = list(read_pieces([f]))
    assert "".join(p.text for p in pieces) == TEXTS[name] and "\ufffd" not in "".join(p.text for p in pieces)
    assert [p.end_of_document for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert sum(p.input_bytes for p in pieces) == f.stat().st_size
    # bounded: a piece is at most a piece's bytes and the last (partial) line part read with it
    assert len(pieces) > f.stat().st_size // (2 * PIECE) and max(len(p.text.encode()) for p in pieces) < 2 * PIECE


def test_the_tokens_of_a_long_line_cut_at_spaces_are_those_of_the_line_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(documents_module, "PIECE_BYTES", PIECE)
    tokenizer = train_bpe([long_line(200)], 400)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for name in ("one_line.txt", "cr.txt"):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_bytes(TEXTS[name].encode())
    assert prepare(tmp_path / "in", "--out", tmp_path / "out", "--tokenizer", tmp_path / "tokenizer.json") == 0
    whole = load_tokenizer_file(str(tmp_path / "tokenizer.json"))
    want = [i for name in ("cr.txt", "one_line.txt") for i in [*whole.encode(TEXTS[name]).ids, 0]]
    assert stream(tmp_path / "out").tolist() == want


def test_a_piece_is_cut_before_the_last_space_between_two_words_else_between_characters():
    """By hand: in b"0123456789ab cd  ef" (19 bytes, the search from byte 9) the spaces at 16 and
    15 touch another space; the one at 12 lies between b and c. Without a space in its second half,
    before the last character's first byte (é is 2 bytes: 10 and 11)."""
    assert documents_module._cut(b"0123456789ab cd  ef") == 12
    assert documents_module._cut(b"0123456789" + "é".encode()) == 10
