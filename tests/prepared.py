"""Tiny corpora for the prepared-directory tests: random sentences written to tmp_path, and
``python -m moe.data prepare`` run in this process."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from moe.data.__main__ import main as data_main
from moe.data.shards import DTYPES, read_manifest

WORDS = (
    "the quick brown fox jumps over a lazy dog while experts route tokens causally and "
    "capacity drops späte wörter ünïcode ≤ ∑ 你好"
).split()


def sentences(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + ".\n" for _ in range(lines))


def write_texts(folder: Path, num_files: int = 3, lines: int = 150) -> list[str]:
    """Text files a.txt, b.txt, ... (the last one in a subfolder) and a hidden file that
    ``prepare`` must skip; returns the documents in the order prepare reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(num_files):
        path = folder / ("sub" if i == num_files - 1 else "") / f"{chr(97 + i)}.txt"
        path.parent.mkdir(exist_ok=True)
        docs.append(sentences(i, lines))
        path.write_text(docs[-1], encoding="utf-8")
    (folder / ".hidden.txt").write_text("never read")
    return docs


def prepare(*args: str) -> int:
    """``python -m moe.data prepare ARGS --no-progress`` in this process; its exit status."""
    return data_main(["prepare", *map(str, args), "--no-progress"])


def stream(directory: Path) -> np.ndarray:
    """Every token id of a prepared directory, shards concatenated (read whole: tests only)."""
    m = read_manifest(directory)
    return np.concatenate([np.fromfile(directory / s["file"], dtype=DTYPES[m["dtype"]]) for s in m["shards"]])


def documents(directory: Path) -> list[list[int]]:
    """The token ids of each document (the stream cut after each end-of-document token)."""
    ids, eot = stream(directory).tolist(), read_manifest(directory)["eot_id"]
    docs, current = [], []
    for i in ids:
        if i == eot:
            docs.append(current)
            current = []
        else:
            current.append(i)
    assert not current, "the stream ends with an end-of-document token"
    return docs


def decoded(directory: Path) -> list[str]:
    """The text of each document of a prepared directory, through its tokenizer (needs ``tokenizers``)."""
    from moe.data.tokenizer import load_tokenizer_file

    tok = load_tokenizer_file(str(directory / read_manifest(directory)["tokenizer"]))
    return [tok.decode(ids, skip_special_tokens=False) for ids in documents(directory)]


LINKED = {
    "files": ["a.txt", "out/o.txt", "sub/b.txt"],
    "already_read": [
        "0first.txt -> sub/b.txt",
        "alias/ -> sub/",
        "hard.txt -> a.txt",
        "loop/ -> ./",
        "z_link.txt -> a.txt",
    ],
    "broken_links": ["gone.txt"],
    "empty": ["empty.txt"],
}
"""What :func:`write_linked_folder`'s folder holds, by hand: the files read (each once, by its own
path), and what is skipped."""


def write_linked_folder(root: Path) -> Path:
    """``root/texts``: three texts (one of them outside, reached through a linked folder), links to
    files and folders read already (sorted before and after what they point at, a hard link, a
    link to the folder itself), a link to nothing and an empty file; see :data:`LINKED`."""
    texts, outside = root / "texts", root / "outside"
    (texts / "sub").mkdir(parents=True)
    outside.mkdir()
    (texts / "a.txt").write_text(sentences(10, 40))
    (texts / "sub" / "b.txt").write_text(sentences(11, 40))
    (outside / "o.txt").write_text(sentences(12, 40))
    (texts / "z_link.txt").symlink_to("a.txt")
    (texts / "0first.txt").symlink_to("sub/b.txt")
    (texts / "hard.txt").hardlink_to(texts / "a.txt")
    (texts / "loop").symlink_to(".")
    (texts / "alias").symlink_to("sub")
    (texts / "out").symlink_to("../outside")
    (texts / "gone.txt").symlink_to("missing.txt")
    (texts / "empty.txt").write_bytes(b"")
    return texts
