"""Tokenize a corpus once into a prepared directory (``python -m moe.data prepare``).

The input is streamed (``moe.data.documents``): pieces of documents are grouped into batches
of about :data:`BATCH_CHARS` characters, encoded in order (in ``workers`` processes, at most
two batches per worker in flight, so memory stays flat however large the input), each
document followed by the end-of-document token (a special token's text inside a document is
encoded as text, never as the token), and appended to shards of ``shard_tokens``
tokens. The output is the same for any number of workers and, shard boundaries aside, any
shard size.

Everything is written into a hidden temporary directory next to ``out``, the manifest last;
only a complete directory is renamed to ``out``. An error removes the temporary directory; a
killed process leaves only that hidden directory, which nothing reads.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moe.data.documents import NotUTF8, Piece, input_files, read_pieces
from moe.data.shards import DTYPES, FORMAT, MANIFEST, check_vocabulary_fits, token_dtype
from moe.data.tokenizer import (
    EOT,
    MIN_BPE_VOCAB,
    load_tokenizer,
    load_tokenizer_file,
    train_bpe,
)

BATCH_CHARS = 1 << 18
"""Characters of text per encoding task."""
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class PrepareConfig:
    """What ``prepare`` reads and writes; validated on construction."""

    input: str
    """A text file, a folder of files (recursive, sorted) or .jsonl / .parquet files."""
    out: str
    """The prepared directory to create (must not exist, or be empty)."""
    train_tokenizer: int | None = None
    """V: train a byte-level BPE of at most V tokens on the input."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` or a local Hugging Face tokenizer folder to encode with."""
    byte_level: bool = False
    """Raw bytes: every byte one token (257 ids: the 256 bytes and ``<|endoftext|>``), no
    tokenizer trained (exactly one of ``train_tokenizer``, ``tokenizer`` and ``byte_level``)."""
    include: list[str] = field(default_factory=list)
    """Globs of a folder's files to read (default: all), matched against the path relative to
    the folder (``*`` crosses ``/``: ``*.py`` is every .py file)."""
    exclude: list[str] = field(default_factory=list)
    """Globs of a folder's files to leave out, matched the same way."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file (the last one holds the rest)."""
    workers: int = 1
    """Encoding processes (1: encode in this process)."""
    text_field: str = "text"
    """The text field of .jsonl records and .parquet columns."""
    eot: str | None = None
    """End-of-document token of a brought tokenizer (default: the folder's eos_token, else
    ``<|endoftext|>`` if the vocabulary has it, else none: documents are just concatenated)."""
    progress: bool = True
    """Show progress bars (on stderr)."""
    encoding_errors: str = "replace"
    """Bytes of text that are not UTF-8: "replace" (each by U+FFFD, counted per file, said and
    recorded in the manifest as ``not_utf8``) or "strict" (refused, naming the file)."""

    def __post_init__(self) -> None:
        if self.encoding_errors not in ("replace", "strict"):
            raise ValueError(f"--encoding-errors must be replace or strict, got {self.encoding_errors!r}")
        if (self.train_tokenizer is not None) + (self.tokenizer is not None) + self.byte_level != 1:
            raise ValueError("give exactly one of --train-tokenizer V, --tokenizer PATH and --bytes")
        if self.train_tokenizer is not None and self.train_tokenizer < MIN_BPE_VOCAB:
            raise ValueError(
                f"--train-tokenizer {self.train_tokenizer}: a byte-level BPE needs at least "
                f"{MIN_BPE_VOCAB} tokens (256 bytes + the end-of-document token)"
            )
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")


@dataclass(frozen=True)
class Encoder:
    """Encodes a batch of pieces into one array of token ids (picklable: sent to workers)."""

    tokenizer_file: str
    eot_id: int | None
    dtype: str

    def __call__(self, batch: list[Piece]) -> np.ndarray:
        tokenizer = load_tokenizer_file(self.tokenizer_file)
        # A special token's text in a document ("<|endoftext|>" in a file that talks about it) is
        # text: encoded as its bytes / subwords, never as the token (a document boundary).
        tokenizer.encode_special_tokens = True
        encodings = tokenizer.encode_batch([p.text for p in batch], add_special_tokens=False)
        parts = []
        for piece, enc in zip(batch, encodings):
            parts.append(np.asarray(enc.ids, dtype=DTYPES[self.dtype]))
            if piece.end_of_document and self.eot_id is not None:
                parts.append(np.array([self.eot_id], dtype=DTYPES[self.dtype]))
        return np.concatenate(parts) if parts else np.zeros(0, DTYPES[self.dtype])


_worker_encoder: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_encoder = encoder


def _encode_in_worker(batch: list[Piece]) -> np.ndarray:
    return _worker_encoder(batch)


def batches(pieces: Iterable[Piece], max_chars: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into lists of about ``max_chars`` characters."""
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encoded(encoder: Encoder, work: Iterable[list[Piece]], workers: int) -> Iterator[tuple[list[Piece], np.ndarray]]:
    """(batch, its token ids) for every batch of ``work``, in order; ``workers`` > 1 encodes in
    spawned processes with at most two batches per worker in flight."""
    if workers == 1:
        for batch in work:
            yield batch, encoder(batch)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending: collections.deque = collections.deque()
        for batch in work:
            pending.append((batch, pool.apply_async(_encode_in_worker, (batch,))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


class ShardWriter:
    """Appends token ids of a vocabulary of ``vocab_size`` to ``shard-NNNNN.bin`` files of
    ``shard_tokens`` tokens each (ValueError if the vocabulary does not fit ``dtype``)."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int, vocab_size: int) -> None:
        check_vocabulary_fits(vocab_size, dtype, f"shards in {directory}")
        self.directory, self.dtype, self.shard_tokens = directory, DTYPES[dtype], shard_tokens
        self.shards: list[dict] = []
        """{"file", "num_tokens"} of every shard begun."""
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                name = f"shard-{len(self.shards):05d}.bin"
                self._file = (self.directory / name).open("wb")
                self.shards.append({"file": name, "num_tokens": 0})
            current = self.shards[-1]
            take = ids[: self.shard_tokens - current["num_tokens"]]
            self._file.write(take.astype(self.dtype, copy=False).tobytes())
            current["num_tokens"] += take.size
            ids = ids[take.size :]
            if current["num_tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty directory")


def _not_utf8(cfg: PrepareConfig) -> NotUTF8:
    return NotUTF8(cfg.encoding_errors == "strict", Path(cfg.input))


def _tokenizer(cfg: PrepareConfig, files: list[Path]) -> tuple[object, int | None, str | None]:
    """(tokenizer, end-of-document id, its token) as ``cfg`` asks: the bytes alone, trained on
    ``files``, or loaded."""
    if cfg.byte_level:
        tokenizer, eot = train_bpe([], MIN_BPE_VOCAB), cfg.eot or EOT  # no pair to merge: the bytes alone
    elif cfg.train_tokenizer is not None:
        total = sum(f.stat().st_size for f in files)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="train tokenizer", disable=not cfg.progress)

        def texts() -> Iterator[str]:
            for piece in read_pieces(files, cfg.text_field, _not_utf8(cfg)):
                bar.update(piece.input_bytes)
                yield piece.text

        tokenizer = train_bpe(texts(), cfg.train_tokenizer)
        bar.close()
        eot = cfg.eot or EOT
    else:
        tokenizer, found = load_tokenizer(cfg.tokenizer)
        eot = cfg.eot or found
    eot_id = tokenizer.token_to_id(eot) if eot is not None else None
    if eot is not None and eot_id is None:
        raise ValueError(f"end-of-document token {eot!r} is not in the tokenizer's vocabulary")
    return tokenizer, eot_id, eot


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenize ``cfg.input`` into the prepared directory ``cfg.out``; return its manifest."""
    selection = input_files(cfg.input, cfg.include, cfg.exclude)
    files = selection.files
    out = Path(cfg.out)
    _check_out(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer, eot_id, eot = _tokenizer(cfg, files)
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        dtype = token_dtype(vocab_size)
        writer = ShardWriter(tmp, dtype, cfg.shard_tokens, vocab_size)
        bar = tqdm(
            total=sum(f.stat().st_size for f in files),
            unit="B",
            unit_scale=True,
            desc="tokenize",
            disable=not cfg.progress,
        )
        documents = 0
        encoder = Encoder(str(tmp / TOKENIZER_FILE), eot_id, dtype)
        not_utf8 = _not_utf8(cfg)
        pieces = read_pieces(files, cfg.text_field, not_utf8)
        for batch, ids in encoded(encoder, batches(pieces, BATCH_CHARS), cfg.workers):
            writer.write(ids)
            documents += sum(p.end_of_document for p in batch)
            bar.update(sum(p.input_bytes for p in batch))
        writer.close()
        bar.close()
        num_tokens = sum(s["num_tokens"] for s in writer.shards)
        if num_tokens <= documents * (eot_id is not None):
            raise ValueError(f"input {cfg.input!r} holds no text")
        manifest = {
            "format": FORMAT,
            "version": 1,
            "vocab_size": vocab_size,
            "dtype": dtype,
            "byte_order": "little",
            "num_tokens": num_tokens,
            "num_documents": documents,
            "eot_id": eot_id,
            "eot_token": eot,
            "tokenizer": TOKENIZER_FILE,
            "shards": writer.shards,
            "input": str(Path(cfg.input).resolve()),
            "num_files": len(files),
            "skipped": selection.left_out(),
            "not_utf8": not_utf8.record(),
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("input", "out", "progress")},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _check_out(out)  # nobody filled it meanwhile
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
