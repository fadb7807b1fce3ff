"""A user's text too short for the evaluation's windows (a few KB against the study's 128
windows of 64 tokens): the trainer refuses it in one line that names the corpus and says about
how many tokens would do, and a text of that many tokens does."""

import pytest
from test_train_cli import RUN, refused

from moe.data import eval_offsets, load_corpus
from moe.training.batches import check_eval_windows

TEXT = "नमस्ते दुनिया, 你好世界, مرحبا بالعالم 👋🏽\r\n"
"""Devanagari, Chinese, Arabic and an emoji with a skin tone, CRLF line ends (89 bytes a line)."""


def test_too_few_validation_windows_name_the_corpus_and_the_size_that_fits(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_bytes(TEXT.encode() * 20)  # 1,781 bytes with the newline read after it: 178 val
    err = refused([*RUN, "--steps", "1", "--data", str(short), "--eval-windows", "12"], capsys)
    assert err.count("\n") == 0 and err.startswith(
        f"error: the corpus {short} (1 files) has 178 val tokens, 11 windows"
    )
    # 12 windows of 16 need 12 * 16 + 1 = 193 val tokens: 1,781 * 193 / 178 = 1,931.1 -> 1,932 tokens in all
    assert "fewer than the 12 of --eval-windows: use more data (about 1,932 tokens in all)" in err, err

    enough = tmp_path / "enough.txt"
    enough.write_bytes((TEXT.encode() * 30)[: 1932 - 1])  # the newline after the file is the last token
    corpus = load_corpus(str(enough), max_bytes=10**6)
    assert corpus.train.numel() + corpus.val.numel() == 1932
    check_eval_windows(corpus, 16, 12)
    assert eval_offsets(corpus.val.numel(), 16, 12).tolist() == [16 * w for w in range(12)]
    with pytest.raises(ValueError, match=f"the corpus {enough} .* 12 windows of seq_len 16, fewer than the 13"):
        check_eval_windows(corpus, 16, 13)
