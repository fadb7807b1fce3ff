"""A document whose text holds a special token's text (this package's own docs say
``<|endoftext|>``; an HTML file says ``<s>``) is prepared as text: the end-of-document token
appears once per document, after it, so ``num_documents`` is the number of end-of-document ids
in the shards, and every document decodes back to its file."""

from extras import need

need("tokenizers", "data")

from prepared import decoded, documents, prepare, sentences, stream  # noqa: E402

from moe.data.shards import read_manifest  # noqa: E402
from moe.data.tokenizer import EOT, train_bpe  # noqa: E402

TEXTS = [
    f"{sentences(0, 30)}Each document ends with {EOT} in the shards.\n",
    f"{EOT}{EOT} starts this one, and <s>struck</s> text.\n{sentences(1, 30)}",
    sentences(2, 30),
]


def check(out, tokenizer_text: str | None = None) -> None:
    m = read_manifest(out)
    ids = stream(out)
    assert m["num_documents"] == len(TEXTS) == int((ids == m["eot_id"]).sum()), m
    assert len(documents(out)) == len(TEXTS) and decoded(out) == TEXTS


def test_a_special_tokens_text_is_text_for_a_trained_bpe_and_for_bytes(tmp_path):
    for i, text in enumerate(TEXTS):
        (tmp_path / "texts").mkdir(exist_ok=True)
        (tmp_path / "texts" / f"{i}.txt").write_text(text, encoding="utf-8")
    assert prepare(tmp_path / "texts", "--out", tmp_path / "bpe", "--train-tokenizer", 300) == 0
    check(tmp_path / "bpe")
    assert prepare(tmp_path / "texts", "--out", tmp_path / "bytes", "--bytes") == 0
    check(tmp_path / "bytes")
    # bytes: one token per UTF-8 byte of each file, and its end-of-document token
    assert stream(tmp_path / "bytes").size == sum(len(t.encode()) + 1 for t in TEXTS)


def test_a_brought_tokenizers_special_tokens_are_text_too(tmp_path):
    tokenizer = train_bpe([sentences(3, 50)], 300)
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for i, text in enumerate(TEXTS):
        (tmp_path / "texts").mkdir(exist_ok=True)
        (tmp_path / "texts" / f"{i}.txt").write_text(text, encoding="utf-8")
    assert prepare(tmp_path / "texts", "--out", tmp_path / "out", "--tokenizer", tmp_path / "tokenizer.json") == 0
    check(tmp_path / "out")
    special = {tokenizer.token_to_id(t) for t in ("<s>", "</s>")}
    assert not special & set(stream(tmp_path / "out").tolist())
