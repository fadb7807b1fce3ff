"""Sample text from a trained model, decoded through the tokenizer of the data it was trained on.

    python experiments/train.py --data data/mine --steps 300 --checkpoint-dir runs/mine --export-model
    python experiments/generate.py runs/mine/model.pt --data data/mine --max-new-tokens 200
    python experiments/generate.py runs/bytes/model.pt --prompt "def " --num-samples 3 --temperature 0.8 --top-k 40

The model is a run's consolidated export (``--export-model`` writes ``<checkpoint_dir>/model.pt``).
``--data`` names the corpus it was trained on (default ``stdlib``): a prepared directory's
tokenizer encodes the prompt and decodes the samples; a byte corpus decodes as UTF-8. Without
``--prompt`` the prompt is ``--prompt-tokens`` tokens of the validation split from its first
line or document start, within one stretch of the corpus (the split is 20 stretches). The prompt and each sample are printed under their own header line
(``--- prompt ... ---``, ``--- sample ... ---``), so where the model's text begins is plain.
Past the model's context each token is predicted from the last ``max_seq_len`` tokens
(nanoGPT's crop), and a line says so. Routers that cannot decode from a KV cache (expert
choice, sequence-sized capacity) sample by recomputing every prefix, which is what serving
them costs.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from moe.data import Corpus, is_prepared, load_corpus, split_ranges
from moe.data.shards import read_manifest
from moe.model import MoETransformer
from moe.training import load_export
from moe.training.batches import DataConfig

BOUNDARY_SEARCH = 4096
"""How many validation tokens the default prompt's start is looked for in."""
VAL_FRACTION = DataConfig.val_fraction
"""The split the corpus is loaded with: the trainer's default, so the prompt comes from the
validation split the model was evaluated on."""


def default_prompt(
    corpus: Corpus, num_tokens: int, eot_id: int | None, stretches: list[int] | None = None
) -> tuple[list[int], str]:
    """(``num_tokens`` tokens of the validation split from its first document or line start, where
    they start in words): the first position after an end-of-document token or a token whose
    text holds a line end, in the first :data:`BOUNDARY_SEARCH` tokens, with ``num_tokens`` tokens
    of its stretch after it (``stretches``: the lengths of the split's contiguous pieces of the
    corpus, in order; None: one piece), so that the prompt is the corpus's text, never two
    pieces joined; else the start with the most of its stretch after it (fewer tokens); else the
    split's start, at most its first stretch."""
    n = corpus.val.numel()
    ends = list(itertools.accumulate(stretches)) if stretches else [n]
    window = [int(t) for t in corpus.val[torch.arange(min(n, BOUNDARY_SEARCH))]]
    texts: dict[int, str] = {}
    longest = None
    for p in range(1, len(window)):
        if p + num_tokens > n:  # too late in the split for the prompt: no start
            break
        before = window[p - 1]
        if before == eot_id or "\n" in texts.setdefault(before, corpus.decode([before])):
            end = min(p + num_tokens, next(e for e in ends if e > p))
            where = f"from the start of {'a document' if before == eot_id else 'a line'}"
            if end == p + num_tokens:
                return [int(t) for t in corpus.val[torch.arange(p, end)]], where
            if longest is None or end - p > len(longest[0]):
                longest = ([int(t) for t in corpus.val[torch.arange(p, end)]], where)
    if longest is not None:
        prompt, where = longest
        return prompt, (
            f"{where}, to the end of its stretch of the corpus (the split's {len(ends)} stretches hold at most "
            f"{max(stretches):,} tokens)"
        )
    start = [int(t) for t in corpus.val[torch.arange(min(ends[0], num_tokens))]]
    return start, f"from its start (no line starts in its first {len(window):,} tokens)"


def cropped(prompt_tokens: int, new_tokens: int, context: int) -> str:
    """A line saying how the context window was cropped, "" when prompt and sample fit in it."""
    total = prompt_tokens + new_tokens
    if prompt_tokens > context:
        return (
            f"the prompt's {prompt_tokens:,} tokens exceed the model's context of {context:,}: it read the last "
            f"{context:,}, and each new token was predicted from the last {context:,} tokens only"
        )
    if total > context:
        return (
            f"prompt and sample ({total:,} tokens) run past the model's context of {context:,}: from token "
            f"{context + 1:,} on, each was predicted from the last {context:,} tokens only"
        )
    return ""


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("export", help="model.pt written by a run with --export-model")
    p.add_argument(
        "--data",
        default="stdlib",
        help="the corpus the model was trained on (a prepared directory, 'stdlib' or a text path; default: stdlib)",
    )
    p.add_argument("--prompt", help="prompt text (default: the validation split from its first line start)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of the default prompt")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prompt == "" or args.prompt_tokens < 1:
        p.error("the prompt is empty: give --prompt some text, or --prompt-tokens of at least 1")
    if args.num_samples < 1:
        p.error(f"--num-samples must be >= 1, got {args.num_samples}")
    try:
        model = load_export(args.export)
        corpus = load_corpus(args.data, VAL_FRACTION)
    except (ValueError, OSError) as e:  # a missing or unreadable model file or --data path, said in one line
        p.error(str(e))
    if model.vocab_size < corpus.vocab_size or (
        isinstance(model, MoETransformer) and model.vocab_size != corpus.vocab_size
    ):
        p.error(
            f"the model has vocab_size={model.vocab_size}, the data {args.data!r} {corpus.vocab_size}: "
            "pass the --data it was trained on"
        )
    if args.prompt is not None:
        prompt, where = corpus.encode(args.prompt), "given"
    else:
        eot_id = read_manifest(args.data)["eot_id"] if is_prepared(args.data) else None
        _, val_ranges = split_ranges(corpus.train.numel() + corpus.val.numel(), VAL_FRACTION)
        prompt, where = default_prompt(corpus, args.prompt_tokens, eot_id, [b - a for a, b in val_ranges])
        where = f"of the validation split, {where}"
    prompt_BT = torch.as_tensor(prompt, dtype=torch.long).view(1, -1).expand(args.num_samples, -1)
    try:
        with torch.no_grad():
            out_BS = model.generate(
                prompt_BT,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=args.seed,
                recompute=model.decode_support() is not None,
            )
    except ValueError as e:  # a sampling option out of range: --max-new-tokens, --temperature, --top-k
        p.error(str(e))
    print(f"--- prompt: {len(prompt):,} tokens {where} ---")
    print(corpus.decode(prompt))
    note = cropped(len(prompt), args.max_new_tokens, model.max_seq_len)
    for k, row in enumerate(out_BS):
        which = f" {k + 1} of {args.num_samples}" if args.num_samples > 1 else ""
        print(f"--- sample{which}: {args.max_new_tokens:,} new tokens ---")
        print(corpus.decode(row[len(prompt) :]))
    if note:
        print(f"--- {note} ---")
    return [corpus.decode(row) for row in out_BS]


if __name__ == "__main__":
    main(sys.argv[1:])
