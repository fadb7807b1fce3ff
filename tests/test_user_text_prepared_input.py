"""A prepared directory where text is expected: ``prepare`` given one as its input refuses it
in one line, and a folder of texts holding one (``prepare texts/ --out texts/mine``, then
``prepare texts/`` again) reads its texts and skips the prepared directory whole, for
``prepare`` and for ``--data`` alike; another tool's ``manifest.json`` is still text."""

from extras import need

need("tokenizers", "data")

from prepared import decoded, prepare, write_texts  # noqa: E402

from moe.data import load_corpus, read_bytes, select_files  # noqa: E402
from moe.data.shards import read_manifest  # noqa: E402


def test_a_prepared_directory_as_input_is_one_line_and_exit_2(tmp_path, capsys):
    write_texts(tmp_path / "texts", num_files=2, lines=20)
    assert prepare(tmp_path / "texts", "--out", tmp_path / "mine", "--bytes") == 0
    capsys.readouterr()
    assert prepare(tmp_path / "mine", "--out", tmp_path / "again", "--bytes") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{str(tmp_path / 'mine')!r} is a prepared directory" in err, err
    assert not (tmp_path / "again").exists()


def test_a_prepared_directory_inside_a_text_folder_is_skipped_whole(tmp_path, capsys):
    docs = write_texts(tmp_path / "texts", num_files=2, lines=20)  # a.txt, sub/b.txt
    (tmp_path / "texts" / "web").mkdir()
    (tmp_path / "texts" / "web" / "manifest.json").write_text('{"name": "an app"}\n')  # not ours: text
    docs.append('{"name": "an app"}\n')
    assert prepare(tmp_path / "texts", "--out", tmp_path / "texts" / "mine", "--bytes") == 0
    first = read_manifest(tmp_path / "texts" / "mine")
    assert first["num_documents"] == 3 and first["skipped"]["prepared_dirs"] == []
    capsys.readouterr()

    assert prepare(tmp_path / "texts", "--out", tmp_path / "again", "--bytes") == 0
    out = capsys.readouterr().out
    assert "1 prepared directory (token ids, not text: mine)" in out, out
    again = read_manifest(tmp_path / "again")
    assert again["skipped"]["prepared_dirs"] == ["mine"] and again["num_files"] == 3
    assert decoded(tmp_path / "again") == docs  # the texts, nothing of mine/
    assert again["num_tokens"] == first["num_tokens"]

    sel = select_files(tmp_path / "texts")
    assert [f.relative_to(tmp_path / "texts").as_posix() for f in sel.files] == [
        "a.txt",
        "sub/b.txt",
        "web/manifest.json",
    ]
    assert read_bytes(sel.files, 10**6) == b"".join(d.encode() + b"\n" for d in docs)  # --data's byte stream
    corpus = load_corpus(str(tmp_path / "texts"), max_bytes=10**6)
    assert corpus.train.numel() + corpus.val.numel() == sum(len(d.encode()) + 1 for d in docs)
    assert "(3 files; skipped 1 prepared directory (token ids, not text: mine))" in corpus.source
