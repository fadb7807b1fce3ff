"""``prepare --tokenizer PATH`` given what is not a tokenizer: a folder of texts (the input's own
folder, say) is refused in one line that says it holds no tokenizer file and how to train one,
before transformers is asked to convert it; a text file does not load; and a folder that
transformers cannot convert is said in one line whole (its first line alone ended in "one of:")."""

from extras import need, needs

need("tokenizers", "data")

from prepared import prepare, write_texts  # noqa: E402


def refused(capsys, tmp_path, *args) -> str:
    assert prepare(tmp_path / "texts", "--out", tmp_path / "out", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists(), err
    return err


def test_a_folder_of_texts_is_no_tokenizer(tmp_path, capsys):
    write_texts(tmp_path / "texts", num_files=2, lines=10)
    err = refused(capsys, tmp_path, "--tokenizer", tmp_path / "texts")
    assert f"tokenizer folder {str(tmp_path / 'texts')!r} holds no tokenizer (none of tokenizer.json, " in err, err
    assert "to train one on the input, --train-tokenizer V" in err
    err = refused(capsys, tmp_path, "--tokenizer", tmp_path / "texts" / "a.txt")
    assert f"tokenizer {str(tmp_path / 'texts' / 'a.txt')!r} does not load: " in err, err


@needs("transformers", "hf")
def test_a_folder_transformers_cannot_convert_is_said_whole(tmp_path, capsys):
    write_texts(tmp_path / "texts", num_files=1, lines=10)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    err = refused(capsys, tmp_path, "--tokenizer", tmp_path / "tok")
    assert err.startswith(
        f"python -m moe.data prepare: error: tokenizer folder {str(tmp_path / 'tok')!r} does not load"
    )
    assert not err.rstrip().endswith("one of:"), err
