"""``python -m moe.data prepare INPUT --out DIR``: tokenize a corpus into memory-mapped shards.

    python -m moe.data prepare corpus/ --out data/mine --train-tokenizer 8192
    python -m moe.data prepare corpus/ --out data/bytes --bytes --include '*.txt'
    python -m moe.data prepare docs.jsonl --out data/docs --tokenizer path/to/hf_tokenizer_folder --workers 4

Bad input is one line on stderr and exit status 2 (nothing is left behind looking complete).
What a folder held that was not read (links to files already read, links to nothing, empty
files, files that are not text, cache folders, prepared directories, files left out by ``--include`` / ``--exclude``)
is said in one line, and listed in the manifest; so is why a trained tokenizer has fewer tokens
than ``--train-tokenizer`` asked for, and how many bytes of which files were not UTF-8 (replaced
by U+FFFD, ``not_utf8`` in the manifest; ``--encoding-errors strict`` refuses them instead).
"""

from __future__ import annotations

import argparse
import sys

from moe.data.documents import NotUTF8
from moe.data.files import FileSelection
from moe.data.prepare import PrepareConfig, prepare
from moe.data.tokenizer import short_vocabulary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe.data", description="Prepared token directories.")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare", help="tokenize INPUT into token shards + manifest.json", description=PrepareConfig.__doc__
    )
    prep.add_argument("input", help="a text file, a folder of files (recursive) or .jsonl / .parquet files")
    prep.add_argument("--out", required=True, help="the prepared directory to create (absent or empty)")
    how = prep.add_mutually_exclusive_group(required=True)
    how.add_argument("--train-tokenizer", type=int, metavar="V", help="train a byte-level BPE of V tokens on INPUT")
    how.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a local Hugging Face tokenizer folder")
    how.add_argument(
        "--bytes", dest="byte_level", action="store_true", help="raw bytes: every byte one token (vocabulary 257)"
    )
    for flag, verb in (("include", "read only"), ("exclude", "leave out")):
        prep.add_argument(
            f"--{flag}",
            action="append",
            default=[],
            metavar="GLOB",
            help=f"{verb} a folder's files matching GLOB (relative path; '*' crosses '/'); repeatable",
        )
    prep.add_argument("--shard-tokens", type=int, default=PrepareConfig.shard_tokens, help="tokens per shard file")
    prep.add_argument("--workers", type=int, default=PrepareConfig.workers, help="encoding processes")
    prep.add_argument("--text-field", default=PrepareConfig.text_field, help="text field of .jsonl / .parquet")
    prep.add_argument("--eot", help="end-of-document token of --tokenizer (default: its eos / <|endoftext|>)")
    prep.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    prep.add_argument(
        "--encoding-errors",
        choices=("replace", "strict"),
        default=PrepareConfig.encoding_errors,
        help="text bytes that are not UTF-8: replace each by U+FFFD (counted, said, in the manifest) or refuse",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    try:
        manifest = prepare(PrepareConfig(**args))
    except (ValueError, ImportError, OSError) as e:  # bad input, a missing extra, an unwritable --out
        print(f"python -m moe.data prepare: error: {e}", file=sys.stderr)
        return 2
    replaced = NotUTF8()
    replaced.files = manifest["not_utf8"]["files"]
    if note := replaced.said():
        print(note, file=sys.stderr)
    skipped = FileSelection([], **manifest["skipped"]).skipped()
    if skipped:
        print(f"{args['input']}: read {manifest['num_files']:,} files, {skipped}")
    print(
        f"wrote {args['out']}: {manifest['num_tokens']:,} tokens of {manifest['num_documents']:,} documents in "
        f"{len(manifest['shards'])} shards ({manifest['dtype']}, vocabulary {manifest['vocab_size']:,})"
    )
    if args["train_tokenizer"] is not None and (
        note := short_vocabulary(args["train_tokenizer"], manifest["vocab_size"])
    ):
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
