"""experiments/generate.py on a user's text and on what a user may hand it by mistake.

The default prompt is the corpus's own text: on a short corpus, whose validation split is 20
short stretches of the stream, it never joins two of them. A model path that is missing, a
folder (a run's checkpoint directory), a text file, a file cut short or another torch file; a
--data path that is missing or empty; an empty prompt; sampling options out of range: each is
one ``generate.py: error: ...`` line (after the usage) naming what is wrong and exit status 2,
never a traceback."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from helpers import ROOT

from moe.data import load_corpus, split_ranges
from moe.model import MoETransformer, preset

sys.path.insert(0, str(ROOT / "experiments"))
import generate  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny byte model's export, its corpus (a text file) and the wrong files of the cases."""
    tmp = tmp_path_factory.mktemp("user")
    cfg = preset("tiny", d_model=16, moe_d_ff=16, vocab_size=256, max_seq_len=16)
    model = tmp / "model.pt"
    torch.save({"model": MoETransformer(cfg).state_dict(), "model_config": dataclasses.asdict(cfg)}, model)
    (tmp / "cut.pt").write_bytes(model.read_bytes()[:1000])
    torch.save({"weights": [1, 2]}, tmp / "other.pt")
    (tmp / "text.txt").write_text("Zeile für Zeile, 行ごとに, سطرا بسطر.\n" * 40, encoding="utf-8")
    (tmp / "empty.txt").write_text("")
    (tmp / "runs").mkdir()
    return tmp


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.pt"], "model file '{tmp}/missing.pt' does not exist: pass the model.pt"),
        (["runs"], "model file '{tmp}/runs' is a folder: pass the model.pt"),
        (["text.txt"], "'{tmp}/text.txt' does not load as a model (invalid load key"),
        (["cut.pt"], "'{tmp}/cut.pt' does not load as a model (PytorchStreamReader"),
        (["other.pt"], "'{tmp}/other.pt' holds no model and its config"),
        (["model.pt", "--data", "{tmp}/missing.txt"], "data path '{tmp}/missing.txt' does not exist"),
        (["model.pt", "--data", "{tmp}/empty.txt"], "data file '{tmp}/empty.txt' is empty"),
        (["model.pt", "--prompt="], "the prompt is empty"),
        (["model.pt", "--prompt-tokens", "0"], "the prompt is empty"),
        (["model.pt", "--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (["model.pt", "--max-new-tokens", "-1"], "max_new_tokens must be an integer >= 0, got -1"),
        (["model.pt", "--top-k", "0"], "top_k must be a positive integer or None, got 0"),
        (["model.pt", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    ],
)
def test_a_wrong_input_is_one_line_and_exit_2(files, capsys, args, message):
    args = [a.format(tmp=files) for a in args]
    argv = [str(files / args[0]), *args[1:]]
    if "--data" not in argv:
        argv += ["--data", str(files / "text.txt")]
    with pytest.raises(SystemExit) as stop:
        generate.main([*argv, "--max-new-tokens", "2"] if "--max-new-tokens" not in argv else argv)
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and ": error: " in err[-1], err
    assert message.format(tmp=files) in err[-1] and "Traceback" not in "\n".join(err), err


def test_the_same_files_sample_when_right(files, capsys):
    texts = generate.main([str(files / "model.pt"), "--data", str(files / "text.txt"), "--max-new-tokens", "3"])
    assert len(texts) == 1 and capsys.readouterr().out.startswith("--- prompt: 11 tokens of the validation split")


def test_the_default_prompt_is_the_corpus_text_never_two_stretches_joined(files, capsys):
    lines = "".join(f"{i:03d} Zeile 行 سطر\n" for i in range(186))  # 21 bytes; numbered: a join shows
    (files / "lines.txt").write_text(lines, encoding="utf-8")
    data = lines.encode() + b"\n"  # the byte corpus: the file and a newline
    corpus = load_corpus(str(files / "lines.txt"))
    _, val_ranges = split_ranges(len(data), 0.1)
    stretch = [b - a for a, b in val_ranges]
    assert corpus.val.numel() == sum(stretch) == 390 and set(stretch) == {19, 20}  # 3,907 bytes: 390 val
    for tokens, header in [
        (16, "--- prompt: 16 tokens of the validation split, from the start of a line ---"),
        (32, "tokens of the validation split, from the start of a line, to the end of its stretch of the corpus"),
    ]:
        generate.main(
            [
                str(files / "model.pt"),
                "--data",
                str(files / "lines.txt"),
                "--prompt-tokens",
                str(tokens),
                "--max-new-tokens",
                "3",
            ]
        )
        first, out = capsys.readouterr().out.split("\n", 1)
        prompt = out.split("\n--- sample: 3 new tokens ---\n")[0]
        assert header in first and int(first.split()[2]) <= min(tokens, 20), first
        # a character cut by the prompt's end decodes as U+FFFD; the rest is the file's text, in one piece
        assert prompt.rstrip("\ufffd") in lines and len(prompt.rstrip("\ufffd")) > 6, (first, prompt)
