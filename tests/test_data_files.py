"""Nothing that is not a user's text reaches the model, and every cut or skip is said: a real
source folder (the standard library's ``email`` package, with its ``__pycache__``) plus binary
files, prepared and read as a byte corpus; a prepared directory that lost its manifest; the
Shakespeare corpus cut by ``--max-bytes``."""

import email
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from extras import need
from helpers import ROOT, SUBPROCESS_ENV

from moe.data import is_text, load_corpus, select_files, split_ranges

EMAIL = Path(email.__file__).parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A copy of the ``email`` package with its ``__pycache__`` (compiled here if the install
    has none), a binary file (an ELF header and code: NUL bytes) and bytes with no NUL that are
    not UTF-8, beside a Latin-1 text (a few invalid bytes: still text)."""
    root = tmp_path_factory.mktemp("folder") / "src"
    shutil.copytree(EMAIL, root / "email")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "email")], check=True)
    (root / "email" / "tool.bin").write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    (root / "noise.dat").write_bytes(bytes(range(1, 256)) * 40)
    (root / "latin1.txt").write_bytes(
        "Le cœur a ses raisons que la raison ne connaît point.\n".encode("latin-1", "replace") * 20
    )
    return root


def expected_text_files(root: Path) -> list[Path]:
    """The reference: the files a user wrote, by their suffix (source, docs, text), sorted by
    relative path, but for the empty ones (``email/mime/__init__.py``)."""
    files = [
        f
        for f in root.rglob("*")
        if f.suffix in (".py", ".rst", ".txt") and "__pycache__" not in f.parts and f.stat().st_size
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def test_is_text_on_real_files(folder):
    pyc = list(folder.rglob("*.pyc"))
    assert len(pyc) >= 20 and not any(is_text(f) for f in pyc)
    assert not is_text(folder / "email" / "tool.bin") and not is_text(folder / "noise.dat")
    assert is_text(folder / "latin1.txt")
    assert all(is_text(f) for f in expected_text_files(folder))


def test_a_folder_selects_its_text_and_says_what_it_skipped(folder):
    sel = select_files(folder)
    assert sel.files == expected_text_files(folder)
    assert sel.not_text == ["email/tool.bin", "noise.dat"]
    assert sel.cache_dirs == ["email/__pycache__", "email/mime/__pycache__"]
    said = sel.skipped()
    assert "2 files that are not text (email/tool.bin, noise.dat)" in said and "2 cache folders (__pycache__)" in said
    # globs on the relative path; '*' crosses '/'
    py = select_files(folder, include=["*.py"], exclude=["email/mime/*"])
    assert py.files == [f for f in expected_text_files(folder) if f.suffix == ".py" and "mime" not in f.parts]
    assert py.excluded == len(sel.files) + 3 - len(py.files) and py.not_text == []  # + 2 not text, 1 empty
    with pytest.raises(ValueError, match="is not text"):
        select_files(folder / "noise.dat")


def test_each_file_is_read_once_and_what_is_not_read_is_said(tmp_path):
    from prepared import LINKED, write_linked_folder

    texts = write_linked_folder(tmp_path)
    sel = select_files(texts)
    assert [f.relative_to(texts).as_posix() for f in sel.files] == LINKED["files"]
    assert (sel.already_read, sel.broken_links, sel.empty) == (
        LINKED["already_read"],
        LINKED["broken_links"],
        LINKED["empty"],
    )
    assert sel.skipped() == (
        "skipped 5 links that point at a file or folder already read (0first.txt -> sub/b.txt, alias/ -> sub/, "
        "hard.txt -> a.txt, loop/ -> ./, z_link.txt -> a.txt); 1 link that points at nothing (gone.txt); "
        "1 file that is empty (empty.txt)"
    )
    corpus = load_corpus(str(texts), val_fraction=0.1, max_bytes=10**8)
    stream = b"".join((texts / f).read_bytes() + b"\n" for f in LINKED["files"])
    train, val = split_ranges(len(stream), 0.1)
    assert bytes(corpus.train.tolist()) == b"".join(stream[a:b] for a, b in train)
    assert bytes(corpus.val.tolist()) == b"".join(stream[a:b] for a, b in val)
    with pytest.raises(ValueError, match="is empty"):
        select_files(texts / "empty.txt")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300
    )


def test_prepare_tokenizes_only_the_text_and_reports_the_rest(folder, tmp_path):
    need("tokenizers", "data")
    from prepared import documents

    from moe.data.tokenizer import load_tokenizer_file

    proc = run("-m", "moe.data", "prepare", folder, "--out", tmp_path / "bytes", "--bytes", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    files = expected_text_files(folder)
    assert (
        f"read {len(files):,} files, skipped 1 file that is empty (email/mime/__init__.py); "
        "2 files that are not text (email/tool.bin, noise.dat)"
    ) in proc.stdout
    manifest = json.loads((tmp_path / "bytes" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 257 and manifest["num_documents"] == len(files)
    assert manifest["skipped"]["not_text"] == ["email/tool.bin", "noise.dat"]
    # every byte one token: each document decodes to its file's text, nothing else is there
    tok = load_tokenizer_file(str(tmp_path / "bytes" / "tokenizer.json"))
    docs = documents(tmp_path / "bytes")
    assert [tok.decode(d) for d in docs] == [f.read_bytes().decode("utf-8", "replace") for f in files]
    assert [len(d) for d in docs[:-1]] == [f.stat().st_size for f in files[:-1]]


def test_a_byte_corpus_from_a_folder_obeys_the_same_rule(folder):
    corpus = load_corpus(str(folder), val_fraction=0.1, max_bytes=10**8)
    stream = b"".join(f.read_bytes() + b"\n" for f in expected_text_files(folder))
    assert corpus.train.numel() + corpus.val.numel() == len(stream)
    assert bytes(corpus.train[:1000].tolist()) == stream[:1000]
    assert b"\x00" not in bytes(corpus.train.tolist()) + bytes(corpus.val.tolist())
    assert "2 files that are not text (email/tool.bin, noise.dat)" in corpus.source and "the first" not in corpus.source


def test_a_prepared_directory_without_its_manifest_is_refused(folder, tmp_path):
    need("tokenizers", "data")
    out = tmp_path / "prepared"
    assert run("-m", "moe.data", "prepare", folder / "email", "--out", out, "--bytes", "--no-progress").returncode == 0
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no manifest.json"):
        load_corpus(str(out))
    proc = run("experiments/train.py", "--preset", "tiny", "--data", out, "--steps", "1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "holds shard-00000.bin, tokenizer.json but no manifest.json" in proc.stderr


def test_a_corpus_cut_by_max_bytes_says_how_much_of_how_much(tmp_path):
    shksprdata = need("shksprdata", "study")
    plays = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    for f in plays:  # the corpus: a folder of the modern-spelling plays
        (tmp_path / f.name).symlink_to(f)
    available = sum(f.stat().st_size + 1 for f in plays)  # each file, then a newline
    assert available > 5_000_000
    cut = load_corpus(str(tmp_path))
    assert cut.train.numel() + cut.val.numel() == 4_000_000
    assert f"the first 4,000,000 of {available:,} bytes" in cut.source
    assert f"--max-bytes {available} takes all" in cut.source
    whole = load_corpus(str(tmp_path), max_bytes=available)
    assert whole.train.numel() + whole.val.numel() == available and "the first" not in whole.source
