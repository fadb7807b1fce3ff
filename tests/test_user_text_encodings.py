"""Text files in another encoding than UTF-8, as users bring them: UTF-16 (Windows' "Unicode",
with its byte order mark, or without: CJK text in it need hold no NUL byte), and a Latin-1
French text whose accents are more than a quarter of its bytes.
Given as the path, each is refused in one line that names the file, the encoding problem and
the conversion (``prepare`` and ``--data`` alike); in a folder, each is skipped as not text."""

import codecs

import pytest
from extras import need

need("tokenizers", "data")

from prepared import prepare  # noqa: E402

from moe.data import is_text, load_corpus, select_files  # noqa: E402

WORDS = ["été", "déjà", "à", "où", "ça", "naïve", "fenêtre", "forêt", "élève"]
FRENCH = " ".join(WORDS[(5 * i) % len(WORDS)] for i in range(900)).encode("latin-1")
BOM = "is not text (a UTF-16 or UTF-32 byte order mark: convert it to UTF-8, iconv -f UTF-16 -t UTF-8)"


def files(tmp_path):
    (tmp_path / "in").mkdir()
    out = {
        "utf16le.txt": "Zeile für Zeile\n".encode("utf-16"),  # the BOM, then little-endian
        "utf16be_cjk.txt": codecs.BOM_UTF16_BE + "专家路由因果模型".encode("utf-16-be") * 40,  # no NUL byte
        "french.txt": FRENCH,
        "utf16_no_bom.txt": "Zeile\n".encode("utf-16-le") * 40,
    }
    for name, data in out.items():
        (tmp_path / "in" / name).write_bytes(data)
    return out


def test_the_cjk_utf16_file_holds_no_nul_byte_and_is_not_text(tmp_path):
    data = files(tmp_path)["utf16be_cjk.txt"]
    assert b"\x00" not in data and not is_text(tmp_path / "in" / "utf16be_cjk.txt")


@pytest.mark.parametrize(
    "name, why",
    [
        ("utf16le.txt", BOM),
        ("utf16be_cjk.txt", BOM),
        ("utf16_no_bom.txt", "is not text (a NUL byte: binary, or UTF-16 without a byte order mark)"),
        (
            "french.txt",
            "is not text ({undecodable:,} of its first {size:,} bytes are not UTF-8, more than 25%: if it is text "
            "in another encoding, Latin-1 say, convert it to UTF-8, iconv -f latin1 -t utf-8)",
        ),
    ],
)
def test_a_file_in_another_encoding_is_one_line_naming_it_and_the_conversion(tmp_path, capsys, name, why):
    files(tmp_path)
    path = tmp_path / "in" / name
    # French: each accent is one Latin-1 byte >= 0x80 before an ASCII byte, so none decodes
    why = why.format(undecodable=sum(b >= 0x80 for b in FRENCH), size=len(FRENCH))
    assert prepare(path, "--out", tmp_path / "out", "--bytes") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data file {str(path)!r} {why}" in err, err
    with pytest.raises(ValueError) as refused:
        load_corpus(str(path))
    assert str(refused.value) == f"data file {str(path)!r} {why}"


def test_in_a_folder_they_are_skipped_as_not_text(tmp_path):
    files(tmp_path)
    (tmp_path / "in" / "ok.txt").write_text("Zeile für Zeile\n", encoding="utf-8")
    sel = select_files(tmp_path / "in")
    assert [f.name for f in sel.files] == ["ok.txt"]
    assert sel.not_text == ["french.txt", "utf16_no_bom.txt", "utf16be_cjk.txt", "utf16le.txt"]
