"""Which files of a user's folder are their text: the one rule behind both ``--data PATH`` (a
byte corpus) and ``python -m moe.data prepare INPUT``.

A folder is walked recursively, following links to folders, its files sorted by relative path.
Each file is read once: a path that names a file already read (a symbolic link to it, a hard
link, a file under a linked folder; a folder reached again through a link is not walked again)
is skipped, and a file's own path is kept before the links to it. Skipped, and counted:

* links to a file or folder already read, and links that point at nothing;
* empty files (0 bytes: no document);
* hidden files and folders (a name starting with ``.``: ``.git``, ``.mypy_cache``, ...) and the
  cache folders of :data:`CACHE_DIRS` (``__pycache__``, ``node_modules``, ...);
* files that ``include`` globs do not match, or ``exclude`` globs do (``fnmatch`` patterns
  matched against the path relative to the folder, where ``*`` also crosses ``/``: ``*.py`` is
  every ``.py`` file at any depth, ``tests/*`` everything under ``tests``);
* files that are not text (:func:`is_text`: a UTF-16 / UTF-32 byte order mark, a NUL byte, or
  more than a quarter of the bytes not UTF-8, in the first :data:`TEXT_SAMPLE_BYTES`), unless their suffix is one the caller
  reads as structured data (``prepare``'s ``.jsonl`` and ``.parquet``);
* prepared directories (``python -m moe.data prepare``'s output, a ``manifest.json`` of format
  ``moe.data.shards``) skipped whole: their files are token ids and a tokenizer, not text. A
  path that is itself one is refused.

A path naming one file selects that file, text or not as the rule says.
"""

from __future__ import annotations

import codecs
import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moe.data.shards import FORMAT, MANIFEST

CACHE_DIRS = frozenset(
    {
        "__pycache__",
        "node_modules",
        ".git",
        ".hg",
        ".svn",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".nox",
        ".ipynb_checkpoints",
        ".venv",
    }
)
"""Folders that hold caches, tools' state or installed packages, never a user's text (the
hidden ones are skipped as hidden anyway; they are named so the report can say which)."""
TEXT_SAMPLE_BYTES = 1 << 16
"""How much of a file :func:`is_text` reads."""
MAX_UNDECODABLE = 0.25
"""A file whose sample has a larger fraction of bytes outside valid UTF-8 is not text (a few
Latin-1 accents in an old text are replaced, not refused)."""
NAMES_SHOWN = 5
"""How many skipped file names a one-line report lists before "and N more"."""


def is_text(path: str | os.PathLike) -> bool:
    """Whether the file reads as text: no UTF-16 / UTF-32 byte order mark, no NUL byte, and at
    most :data:`MAX_UNDECODABLE` of its bytes outside valid UTF-8, in its first
    :data:`TEXT_SAMPLE_BYTES` bytes."""
    return not_text_because(path) is None


def not_text_because(path: str | os.PathLike) -> str | None:
    """Why the file is not text by :func:`is_text`'s rule, in words that say what to do (None
    when it is text)."""
    with open(path, "rb") as fh:
        sample = fh.read(TEXT_SAMPLE_BYTES)
    if sample.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "is not text (a UTF-16 or UTF-32 byte order mark: convert it to UTF-8, iconv -f UTF-16 -t UTF-8)"
    if b"\x00" in sample:
        return "is not text (a NUL byte: binary, or UTF-16 without a byte order mark)"
    # final=False: a character cut by the end of the sample stays in the decoder's buffer, and
    # is not counted as undecodable
    decoder = codecs.getincrementaldecoder("utf-8")("ignore")
    decoded = decoder.decode(sample, final=False)
    undecodable = len(sample) - len(decoded.encode("utf-8")) - len(decoder.getstate()[0])
    if undecodable <= MAX_UNDECODABLE * len(sample):
        return None
    return (
        f"is not text ({undecodable:,} of its first {len(sample):,} bytes are not UTF-8, more than "
        f"{MAX_UNDECODABLE:.0%}: if it is text in another encoding, Latin-1 say, convert it to UTF-8, "
        "iconv -f latin1 -t utf-8)"
    )


def is_prepared_output(folder: Path) -> bool:
    """Whether ``folder`` holds a ``manifest.json`` of a prepared directory (format
    ``moe.data.shards``; another tool's ``manifest.json`` does not count)."""
    try:
        return json.loads((folder / MANIFEST).read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # no manifest, not JSON, not a JSON object
        return False


@dataclass
class FileSelection:
    """The files of a path by the module's rule, and what was left out (relative paths)."""

    files: list[Path]
    """The selected files, sorted by relative path."""
    not_text: list[str] = field(default_factory=list)
    """Files left out because they are not text."""
    cache_dirs: list[str] = field(default_factory=list)
    """Cache folders skipped whole (:data:`CACHE_DIRS`)."""
    excluded: int = 0
    """Files left out by the include / exclude globs."""
    already_read: list[str] = field(default_factory=list)
    """Paths naming a file or folder already read, as ``"link -> the path read"`` (folders end in ``/``)."""
    broken_links: list[str] = field(default_factory=list)
    """Links that point at nothing."""
    empty: list[str] = field(default_factory=list)
    """Files of 0 bytes."""
    prepared_dirs: list[str] = field(default_factory=list)
    """Prepared directories skipped whole (:func:`is_prepared_output`)."""

    def left_out(self) -> dict:
        """What was left out, as a manifest records it (``FileSelection([], **left_out)`` reads it back)."""
        return {
            "not_text": self.not_text,
            "cache_dirs": self.cache_dirs,
            "excluded": self.excluded,
            "already_read": self.already_read,
            "broken_links": self.broken_links,
            "empty": self.empty,
            "prepared_dirs": self.prepared_dirs,
        }

    def skipped(self) -> str:
        """What was left out, in words ("" when nothing was): counts, and the names of the
        files that are not text, read already, broken links or empty (the first :data:`NAMES_SHOWN`)."""
        parts = []
        for names, noun, verb, why in (
            (self.already_read, "link", "points", "at a file or folder already read"),
            (self.broken_links, "link", "points", "at nothing"),
            (self.empty, "file", "is", "empty"),
            (self.not_text, "file", "is", "not text"),
        ):
            if names:
                verb = verb if len(names) == 1 else {"points": "point", "is": "are"}[verb]
                parts.append(f"{_count(len(names), noun)} that {verb} {why} ({_names(names)})")
        if self.cache_dirs:
            kinds = ", ".join(sorted({Path(d).name for d in self.cache_dirs}))
            parts.append(f"{_count(len(self.cache_dirs), 'cache folder')} ({kinds})")
        if self.prepared_dirs:
            n = len(self.prepared_dirs)
            parts.append(
                f"{n:,} prepared director{'y' if n == 1 else 'ies'} (token ids, not text: {_names(self.prepared_dirs)})"
            )
        if self.excluded:
            parts.append(f"{_count(self.excluded, 'file')} by --include / --exclude")
        return "skipped " + "; ".join(parts) if parts else ""


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _names(names: list[str]) -> str:
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return ", ".join(names[:NAMES_SHOWN]) + more


def select_files(
    path: str | os.PathLike,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    structured: Sequence[str] = (),
) -> FileSelection:
    """The files of ``path`` by the module's rule; files with a suffix in ``structured`` are
    exempt from the text test. FileNotFoundError for a missing path, ValueError when nothing
    is left (saying what was skipped)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    if p.is_dir() and is_prepared_output(p):
        raise ValueError(
            f"{str(p)!r} is a prepared directory (its {MANIFEST}): its files are token ids, not text; "
            "train on it with --data, or give the text it was prepared from"
        )
    if p.is_file():
        candidates, sel = [p], FileSelection([])
    else:
        candidates, sel = _walk(p, include, exclude)
        candidates = _each_file_once(p, candidates, sel)
    for f in candidates:
        rel = f.name if f == p else f.relative_to(p).as_posix()
        if f.stat().st_size == 0:
            sel.empty.append(rel)
        elif f.suffix in structured or is_text(f):
            sel.files.append(f)
        else:
            sel.not_text.append(rel)
    if not sel.files and p.is_file():
        raise ValueError(f"data file {str(p)!r} {'is empty' if sel.empty else not_text_because(p)}")
    if not sel.files:
        why = sel.skipped()
        raise ValueError(f"data directory {str(p)!r} holds no text files" + (f" ({why})" if why else ""))
    return sel


def _each_file_once(root: Path, candidates: list[Path], sel: FileSelection) -> list[Path]:
    """``candidates`` (sorted) with each file once, by identity (device and inode, so symbolic
    and hard links alike): a file's path without a link in it is kept before the paths through
    links, the rest are recorded in ``sel``; links to nothing are recorded and left out."""
    real_root = root.resolve()
    kept: dict[tuple[int, int], Path] = {}
    for f in sorted(candidates, key=lambda f: f.resolve() != real_root / f.relative_to(root)):  # stable
        rel = f.relative_to(root).as_posix()
        try:
            st = f.stat()
        except OSError:  # a link to nothing, or to itself
            sel.broken_links.append(rel)
            continue
        first = kept.setdefault((st.st_dev, st.st_ino), f)
        if first != f:
            sel.already_read.append(f"{rel} -> {first.relative_to(root).as_posix()}")
    sel.already_read.sort()
    sel.broken_links.sort()
    read = set(kept.values())
    return [f for f in candidates if f in read]


def _walk(root: Path, include: Sequence[str], exclude: Sequence[str]) -> tuple[list[Path], FileSelection]:
    """(the folder's files that pass the name rules, sorted; a selection holding what the
    name rules skipped). Links to folders are followed once every real folder is walked, each
    folder once (so a link to an enclosing folder, or to one read already, is recorded and ends)."""
    sel, found = FileSelection([]), []
    walked, tops, links = {root.resolve(): root}, [root], []
    while tops:
        for dirpath, dirnames, filenames in os.walk(tops.pop(0)):
            here = Path(dirpath)
            for d in sorted(dirnames):
                if d in CACHE_DIRS:
                    sel.cache_dirs.append((here / d).relative_to(root).as_posix())
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in CACHE_DIRS]
            for d in [d for d in dirnames if is_prepared_output(here / d)]:
                sel.prepared_dirs.append((here / d).relative_to(root).as_posix())
                dirnames.remove(d)
            for d in dirnames:  # os.walk does not descend into links: they wait for the real folders
                if (here / d).is_symlink():
                    links.append(here / d)
                else:
                    walked.setdefault((here / d).resolve(), here / d)
            for name in filenames:
                if name.startswith("."):
                    continue
                rel = (here / name).relative_to(root).as_posix()
                wanted = not include or any(fnmatch.fnmatchcase(rel, g) for g in include)
                if wanted and not any(fnmatch.fnmatchcase(rel, g) for g in exclude):
                    found.append((rel, here / name))
                else:
                    sel.excluded += 1
        if not tops:
            for link in sorted(links):
                first = walked.setdefault(link.resolve(), link)
                if first == link:
                    tops.append(link)
                else:
                    read = first.relative_to(root).as_posix() if first != root else "."
                    sel.already_read.append(f"{link.relative_to(root).as_posix()}/ -> {read}/")
            links = []
    sel.cache_dirs.sort()
    sel.prepared_dirs.sort()
    return [f for _, f in sorted(found)], sel
