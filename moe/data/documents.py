"""The documents of a ``prepare`` input, streamed in pieces of bounded size.

An input is a file or a folder of files (recursively, sorted by relative path; hidden files,
cache folders, files that are not text and files the ``--include`` / ``--exclude`` globs leave
out are skipped: ``moe.data.files``). By suffix: ``.jsonl`` holds one JSON object per line and its text field is one
document; ``.parquet`` (through ``pyarrow``) one document per row of its text column; any
other file is UTF-8 text (invalid bytes replaced) and is one document, read in pieces of
about :data:`PIECE_BYTES` cut after a line end, so a large file never sits in memory whole
(the tokens may differ from encoding the file in one call only where a piece boundary splits
a run of whitespace).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe.data.files import FileSelection, select_files

STRUCTURED = (".jsonl", ".parquet")
"""Suffixes read as records, not as text (exempt from the text test)."""
PIECE_BYTES = 1 << 16
"""Text files are read in pieces of about this many bytes (``tokenizers`` holds about 300
bytes per token of an encoding in flight, so pieces stay small)."""


@dataclass(frozen=True)
class Piece:
    """Consecutive text of one document."""

    text: str
    end_of_document: bool
    """Whether the document ends with this piece (an end-of-document token follows it)."""
    input_bytes: int
    """Input bytes this piece accounts for (for progress)."""


def input_files(path: str | Path, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> FileSelection:
    """The files of an input path and what was skipped (see the module docstring); ValueError
    for a missing path or a folder with no text."""
    try:
        return select_files(path, include, exclude, structured=STRUCTURED)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


def read_pieces(files: Sequence[Path], text_field: str = "text") -> Iterator[Piece]:
    """The pieces of every document of ``files``, in order."""
    for f in files:
        if f.suffix == ".jsonl":
            yield from _jsonl_pieces(f, text_field)
        elif f.suffix == ".parquet":
            yield from _parquet_pieces(f, text_field)
        else:
            yield from _text_pieces(f)


def _text_pieces(f: Path) -> Iterator[Piece]:
    with f.open("rb") as fh:
        chunk: list[bytes] = []
        size = 0
        for line in fh:
            chunk.append(line)
            size += len(line)
            if size >= PIECE_BYTES:
                yield Piece(b"".join(chunk).decode("utf-8", errors="replace"), False, size)
                chunk, size = [], 0
        # the last piece ends the document (possibly empty, after a piece that filled up)
        yield Piece(b"".join(chunk).decode("utf-8", errors="replace"), True, size)


def _jsonl_pieces(f: Path, text_field: str) -> Iterator[Piece]:
    with f.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{lineno}: not a JSON line ({e})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{f}:{lineno}: no string field {text_field!r}")
            yield Piece(text, True, len(line))


def _parquet_pieces(f: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {f} needs pyarrow: pip install 'causal-moe-routing[data]'") from None
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises its own error kinds for a file that is not parquet
        raise ValueError(f"{f} does not read as parquet: {e}") from None
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{f} has no column {text_field!r} (columns: {pf.schema_arrow.names})")
    rows = max(1, pf.metadata.num_rows)
    size = f.stat().st_size
    done = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            done += 1
            if text is not None:
                yield Piece(str(text), True, size * done // rows - size * (done - 1) // rows)
