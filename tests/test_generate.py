"""experiments/generate.py's output: the prompt and each sample under their own header, the
default prompt from the first line start of the validation split, and a line when the sample
ran past the model's context (a random tiny model on the default byte corpus: the text is
noise, the layout is what is tested)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from helpers import ROOT

from moe.data import Corpus, load_corpus
from moe.model import MoETransformer, preset

sys.path.insert(0, str(ROOT / "experiments"))
import generate  # noqa: E402

CONTEXT = 16


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> str:
    """A random tiny model with a 16-token context, saved as ``--export-model`` saves one."""
    torch.manual_seed(0)
    cfg = preset("tiny", d_model=32, moe_d_ff=32, max_seq_len=CONTEXT)
    path = tmp_path_factory.mktemp("export") / "model.pt"
    torch.save({"model": MoETransformer(cfg).state_dict(), "model_config": dataclasses.asdict(cfg)}, path)
    return str(path)


def greedy(export: str, prompt: list[int], n: int) -> list[int]:
    return generate.load_export(export).generate(torch.tensor([prompt]), n, temperature=0)[0].tolist()


def test_the_default_prompt_starts_at_a_line_and_the_sample_is_marked(export, capsys):
    generate.main([export, "--prompt-tokens", "6", "--max-new-tokens", "8", "--temperature", "0"])
    out = capsys.readouterr().out
    corpus = load_corpus("stdlib")
    val = bytes(corpus.val[:4096].tolist())
    start = val.index(b"\n") + 1  # the reference: the first byte after a line end
    prompt = list(val[start : start + 6])
    assert start > 1 and val[start - 1 : start] == b"\n"
    sample = greedy(export, prompt, 8)[6:]
    assert out == (
        "--- prompt: 6 tokens of the validation split, from the start of a line ---\n"
        f"{corpus.decode(prompt)}\n"
        "--- sample: 8 new tokens ---\n"
        f"{corpus.decode(sample)}\n"
    )


def test_a_sample_past_the_context_says_so(export, capsys):
    texts = generate.main([export, "--prompt", "def f", "--max-new-tokens", "14", "--temperature", "0"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- prompt: 5 tokens given ---" and out[1] == "def f"
    assert out[2] == "--- sample: 14 new tokens ---"
    assert out[-1] == (
        "--- prompt and sample (19 tokens) run past the model's context of 16: from token 17 on, "
        "each was predicted from the last 16 tokens only ---"
    )
    assert texts == [load_corpus("stdlib").decode(greedy(export, list(b"def f"), 14))]


def test_within_the_context_nothing_is_said_and_a_long_prompt_is_said(export, capsys):
    generate.main([export, "--prompt", "def f", "--max-new-tokens", "11", "--temperature", "0"])
    assert "context" not in capsys.readouterr().out  # 5 + 11 = 16 tokens: the context exactly
    generate.main([export, "--prompt", "x" * 20, "--max-new-tokens", "2", "--num-samples", "2"])
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("--- sample")] == [
        "--- sample 1 of 2: 2 new tokens ---",
        "--- sample 2 of 2: 2 new tokens ---",
    ]
    assert out[-1] == (
        "--- the prompt's 20 tokens exceed the model's context of 16: it read the last 16, and each new token "
        "was predicted from the last 16 tokens only ---"
    )


def test_the_default_prompt_starts_after_an_end_of_document_token_else_at_the_split_start():
    val = torch.tensor([1, 2, 5, 7, 3, 4, 6, 1, 2, 3], dtype=torch.uint8)  # symbols: no line ends
    corpus = Corpus(train=val.clone(), val=val, vocab_size=8, source="symbols")
    assert generate.default_prompt(corpus, 3, eot_id=7) == ([3, 4, 6], "from the start of a document")
    assert generate.default_prompt(corpus, 3, eot_id=None) == (
        [1, 2, 5],
        "from its start (no line starts in its first 10 tokens)",
    )
    # a boundary too late for the prompt to fit is no boundary
    assert generate.default_prompt(corpus, 7, eot_id=7)[1].startswith("from its start")
