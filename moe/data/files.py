"""Which files of a user's folder are their text: the one rule behind both ``--data PATH`` (a
byte corpus) and ``python -m moe.data prepare INPUT``.

A folder is walked recursively, its files sorted by relative path. Skipped, and counted:

* hidden files and folders (a name starting with ``.``: ``.git``, ``.mypy_cache``, ...) and the
  cache folders of :data:`CACHE_DIRS` (``__pycache__``, ``node_modules``, ...);
* files that ``include`` globs do not match, or ``exclude`` globs do (``fnmatch`` patterns
  matched against the path relative to the folder, where ``*`` also crosses ``/``: ``*.py`` is
  every ``.py`` file at any depth, ``tests/*`` everything under ``tests``);
* files that are not text (:func:`is_text`: a NUL byte, or more than a quarter of the bytes
  not UTF-8, in the first :data:`TEXT_SAMPLE_BYTES`), unless their suffix is one the caller
  reads as structured data (``prepare``'s ``.jsonl`` and ``.parquet``).

A path naming one file selects that file, text or not as the rule says.
"""

from __future__ import annotations

import codecs
import fnmatch
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    """Whether the file reads as text: no NUL byte, and at most :data:`MAX_UNDECODABLE` of
    its bytes outside valid UTF-8, in its first :data:`TEXT_SAMPLE_BYTES` bytes."""
    with open(path, "rb") as fh:
        sample = fh.read(TEXT_SAMPLE_BYTES)
    if b"\x00" in sample:
        return False
    # final=False: a character cut by the end of the sample is not counted as undecodable
    decoded = codecs.getincrementaldecoder("utf-8")("ignore").decode(sample, final=False)
    undecodable = len(sample) - len(decoded.encode("utf-8"))
    return undecodable <= MAX_UNDECODABLE * len(sample)


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

    def left_out(self) -> dict:
        """What was left out, as a manifest records it (``FileSelection([], **left_out)`` reads it back)."""
        return {"not_text": self.not_text, "cache_dirs": self.cache_dirs, "excluded": self.excluded}

    def skipped(self) -> str:
        """What was left out, in words ("" when nothing was): counts, and the names of the
        files that are not text (the first :data:`NAMES_SHOWN`)."""
        parts = []
        if self.not_text:
            names = ", ".join(self.not_text[:NAMES_SHOWN])
            more = f" and {len(self.not_text) - NAMES_SHOWN} more" if len(self.not_text) > NAMES_SHOWN else ""
            parts.append(
                f"{_count(len(self.not_text), 'file')} that {'is' if len(self.not_text) == 1 else 'are'} not text ({names}{more})"
            )
        if self.cache_dirs:
            kinds = ", ".join(sorted({Path(d).name for d in self.cache_dirs}))
            parts.append(f"{_count(len(self.cache_dirs), 'cache folder')} ({kinds})")
        if self.excluded:
            parts.append(f"{_count(self.excluded, 'file')} by --include / --exclude")
        return "skipped " + "; ".join(parts) if parts else ""


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


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
    if p.is_file():
        candidates, sel = [p], FileSelection([])
    else:
        candidates, sel = _walk(p, include, exclude)
    for f in candidates:
        if f.suffix in structured or is_text(f):
            sel.files.append(f)
        else:
            sel.not_text.append(f.name if f == p else f.relative_to(p).as_posix())
    if not sel.files and p.is_file():
        raise ValueError(f"data file {str(p)!r} is not text (a NUL byte, or mostly not UTF-8)")
    if not sel.files:
        why = sel.skipped()
        raise ValueError(f"data directory {str(p)!r} holds no text files" + (f" ({why})" if why else ""))
    return sel


def _walk(root: Path, include: Sequence[str], exclude: Sequence[str]) -> tuple[list[Path], FileSelection]:
    """(the folder's files that pass the name rules, sorted; a selection holding what the
    name rules skipped)."""
    sel, found = FileSelection([]), []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in sorted(dirnames):
            if d in CACHE_DIRS:
                sel.cache_dirs.append((here / d).relative_to(root).as_posix())
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in CACHE_DIRS]
        for name in filenames:
            if name.startswith("."):
                continue
            rel = (here / name).relative_to(root).as_posix()
            wanted = not include or any(fnmatch.fnmatchcase(rel, g) for g in include)
            if wanted and not any(fnmatch.fnmatchcase(rel, g) for g in exclude):
                found.append((rel, here / name))
            else:
                sel.excluded += 1
    sel.cache_dirs.sort()
    return [f for _, f in sorted(found)], sel
