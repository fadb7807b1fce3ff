"""Tokenizers for prepared directories, through the ``tokenizers`` library (the ``[data]``
extra; imported only when a tokenizer is asked for).

Two ways to get one: :func:`train_bpe` trains a byte-level BPE (GPT-2 style: every byte is a
token, so any text encodes, and ``<|endoftext|>`` is id 0), or :func:`load_tokenizer` loads
your own: a ``tokenizer.json`` file, or a local Hugging Face tokenizer folder (its
``tokenizer.json``, or, with ``transformers`` installed, whatever ``AutoTokenizer`` can turn
into a fast tokenizer). Either way the prepared directory keeps a ``tokenizer.json``, so
reading it back needs only ``tokenizers``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

EOT = "<|endoftext|>"
"""The end-of-document token of trained tokenizers (and the default looked for in brought ones)."""
BYTE_ALPHABET = 256
MIN_BPE_VOCAB = BYTE_ALPHABET + 1
"""The smallest byte-level BPE: the 256 bytes and the end-of-document token."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "*.model")
"""What a Hugging Face tokenizer folder holds, one at least (a folder without any is no tokenizer)."""


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "tokenizers are read with the `tokenizers` library: pip install 'causal-moe-routing[data]'"
        ) from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) of at most ``vocab_size`` tokens
    trained on ``texts`` (streamed), with :data:`EOT` as id 0. A small corpus may yield fewer
    tokens than asked for (no pair left to merge)."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"a byte-level BPE needs a vocabulary of at least {MIN_BPE_VOCAB} "
            f"({BYTE_ALPHABET} bytes + {EOT}), got {vocab_size}"
        )
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def short_vocabulary(asked: int, got: int) -> str:
    """Why a BPE trained for ``asked`` tokens has ``got`` (fewer), in one line; "" when it has them
    all. The trainer merges pairs of tokens within a word only (a piece of the byte-level
    pre-tokenizer: a run of letters, of digits, of punctuation, of spaces) and stops when no
    pair is left: every distinct word of its input is then one token."""
    if got >= asked:
        return ""
    return (
        f"the tokenizer has {got:,} tokens, not the {asked:,} asked for: BPE merges only within words "
        "(runs of letters, digits, punctuation or spaces) and ran out of pairs to merge once every distinct "
        "word of the input was one token; more, or more varied, text gives more"
    )


def _folder_eos(folder: Path) -> str | None:
    """The ``eos_token`` of a Hugging Face tokenizer folder's ``tokenizer_config.json``."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(path: str | Path):
    """(tokenizer, end-of-document token or None) of a ``tokenizer.json`` file or a local
    Hugging Face tokenizer folder; ValueError naming ``path`` when it does not load."""
    tk = _tokenizers()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"tokenizer {str(p)!r} does not exist")
    file = p / "tokenizer.json" if p.is_dir() else p
    eos = _folder_eos(p) if p.is_dir() else None
    if file.is_file():
        try:
            tokenizer = tk.Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer {str(file)!r} does not load: {str(e).splitlines()[0]}") from None
    elif not any(next(p.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer folder {str(p)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "--tokenizer takes a tokenizer; to train one on the input, --train-tokenizer V"
        )
    else:
        tokenizer = _converted(p)
    if eos is None and tokenizer.token_to_id(EOT) is not None:
        eos = EOT
    return tokenizer, eos


def _converted(folder: Path):
    """The fast tokenizer ``transformers`` builds from a folder without ``tokenizer.json``."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"tokenizer folder {str(folder)!r} has no tokenizer.json; converting other formats "
            "needs transformers (pip install 'causal-moe-routing[hf]')"
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a folder it cannot read
        why = " ".join(line.strip() for line in str(e).splitlines())  # its first line alone can end in "one of:"
        raise ValueError(f"tokenizer folder {str(folder)!r} does not load: {why}") from None
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"tokenizer folder {str(folder)!r} has no fast (tokenizers) form")
    return hf.backend_tokenizer


@functools.lru_cache(maxsize=8)
def load_tokenizer_file(path: str):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file, cached per process."""
    return _tokenizers().Tokenizer.from_file(path)
