"""The documents of a ``prepare`` input, streamed in pieces of bounded size.

An input is a file or a folder of files (recursively, sorted by relative path; hidden files,
cache folders, files that are not text and files the ``--include`` / ``--exclude`` globs leave
out are skipped: ``moe.data.files``). By suffix: ``.jsonl`` holds one JSON object per line and its text field is one
document; ``.parquet`` (through ``pyarrow``) one document per row of its text column; any
other file is UTF-8 text and is one document (bytes that are not UTF-8 are replaced by U+FFFD
and counted per file, :class:`NotUTF8`, or refused with ``errors="strict"``), read in pieces of
about :data:`PIECE_BYTES` cut after a line end, or inside a longer line before a space between
two words, else between two characters, so a large file never sits in memory whole, even as one
line (the tokens may differ from encoding the file in one call only where a piece boundary splits
a run of whitespace, or a run of characters without a space).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe.data.files import NAMES_SHOWN, FileSelection, select_files

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


class NotUTF8:
    """Bytes of text files (and .jsonl lines) that are not UTF-8, counted per file while they
    are read; with ``strict`` the first such byte is a ValueError naming the file instead."""

    def __init__(self, strict: bool = False, root: Path | None = None) -> None:
        self.strict, self.root = strict, root
        self.files: dict[str, int] = {}
        """File (relative to ``root``, a folder read) -> bytes replaced by U+FFFD."""

    def decode(self, data: bytes, where: Path) -> str:
        text = data.decode("utf-8", errors="replace")
        if "\ufffd" not in text:
            return text
        replaced = len(data) - len(
            data.decode("utf-8", errors="ignore").encode("utf-8")
        )  # a U+FFFD of the input is kept
        if replaced and self.strict:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: the text is not UTF-8 ({replaced} bytes in one piece, the first {data[e.start : e.end]!r}: "
                    f"{e.reason}): convert it, or prepare without --encoding-errors strict (each replaced by U+FFFD, "
                    "counted and recorded)"
                ) from None
        if replaced:
            name = str(where.relative_to(self.root) if self.root is not None and self.root.is_dir() else where)
            self.files[name] = self.files.get(name, 0) + replaced
        return text

    def record(self) -> dict:
        """What the manifest keeps: ``{"replaced_bytes": n, "files": {file: n, ...}}``."""
        return {"replaced_bytes": sum(self.files.values()), "files": dict(self.files)}

    def said(self) -> str | None:
        """One line for the user, or None if every byte was UTF-8."""
        if not self.files:
            return None
        shown = ", ".join(f"{f}: {n:,}" for f, n in list(self.files.items())[:NAMES_SHOWN])
        more = f" and {len(self.files) - NAMES_SHOWN} more" if len(self.files) > NAMES_SHOWN else ""
        return (
            f"warning: {sum(self.files.values()):,} bytes that are not UTF-8 in {len(self.files)} files were replaced "
            f"by U+FFFD ({shown}{more}); recorded in the manifest (not_utf8); --encoding-errors strict refuses them"
        )


def input_files(path: str | Path, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> FileSelection:
    """The files of an input path and what was skipped (see the module docstring); ValueError
    for a missing path or a folder with no text."""
    try:
        return select_files(path, include, exclude, structured=STRUCTURED)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


def read_pieces(files: Sequence[Path], text_field: str = "text", not_utf8: NotUTF8 | None = None) -> Iterator[Piece]:
    """The pieces of every document of ``files``, in order; bytes that are not UTF-8 counted
    into (or refused by) ``not_utf8``."""
    not_utf8 = NotUTF8() if not_utf8 is None else not_utf8
    for f in files:
        if f.suffix == ".jsonl":
            yield from _jsonl_pieces(f, text_field, not_utf8)
        elif f.suffix == ".parquet":
            yield from _parquet_pieces(f, text_field)
        else:
            yield from _text_pieces(f, not_utf8)


def _text_pieces(f: Path, not_utf8: NotUTF8) -> Iterator[Piece]:
    with f.open("rb") as fh:
        chunk: list[bytes] = []
        size = 0
        # lines of at most PIECE_BYTES: a longer one (a file without line ends, or with lone CRs)
        # comes in parts, and the piece is cut inside it (_cut)
        for line in iter(lambda: fh.readline(PIECE_BYTES), b""):
            chunk.append(line)
            size += len(line)
            if size >= PIECE_BYTES:
                data = b"".join(chunk)
                cut = size if len(line) < PIECE_BYTES or line.endswith(b"\n") else _cut(data)
                yield Piece(not_utf8.decode(data[:cut], f), False, cut)
                chunk, size = [data[cut:]], size - cut
        # the last piece ends the document (possibly empty, after a piece that filled up)
        yield Piece(not_utf8.decode(b"".join(chunk), f), True, size)


def _cut(data: bytes) -> int:
    """Where to cut a piece that ends inside a line: before the last space between two
    non-spaces in its second half (the byte-level pre-tokenizer splits there anyway: the same
    tokens as the line read whole), else before its last character (never inside one)."""
    i = len(data) - 1
    while (i := data.rfind(b" ", len(data) // 2, i)) > 0:
        if not data[i - 1 : i].isspace() and not data[i + 1 : i + 2].isspace():
            return i
    i = len(data) - 1
    while i > 0 and data[i] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        i -= 1
    return i or len(data)  # no character start at all (not UTF-8): the whole piece


def _jsonl_pieces(f: Path, text_field: str, not_utf8: NotUTF8) -> Iterator[Piece]:
    with f.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(not_utf8.decode(line, f))
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
