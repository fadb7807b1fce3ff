"""Texts the study never saw, prepared with a trained BPE and as bytes: Chinese, Japanese,
Arabic (right to left), Devanagari, emoji with skin tones, flags and ZWJ sequences, combining
marks, CRLF and lone-CR line ends, a UTF-8 byte order mark. Each document decodes back to its
file's very text (line ends and the mark kept, as docs/data.md says), every text encodes and
decodes to itself, and the corpus's split has the manifest's tokens: train and validation
disjoint, covering the stream, the validation part ``floor(0.1 N)`` tokens in 20 stretches."""

import math

import numpy as np
import torch
from extras import need

need("tokenizers", "data")

from prepared import decoded, prepare, stream  # noqa: E402

from moe.data import load_corpus, split_ranges  # noqa: E402
from moe.data.shards import read_manifest  # noqa: E402
from moe.data.tokenizer import load_tokenizer_file  # noqa: E402


def lines(words: list[str], n: int, sep: str = " ", end: str = "\n") -> str:
    return "".join(sep.join(words[(3 * i + k) % len(words)] for k in range(9)) + end for i in range(n))


TEXTS = {
    "ar.txt": lines(["الخبراء", "التوجيه", "النموذج", "اللغة", "في", "من", "،", "."], 40),
    "bom.txt": "\ufeff" + lines(["the", "router", "sends", "tokens", "to", "experts"], 40),
    "cr.txt": lines(["lone", "carriage", "returns", "end", "these", "lines"], 40, end="\r"),
    "crlf.txt": lines(["windows", "line", "ends", "here", "too"], 40, end="\r\n"),
    "emoji.txt": lines(["👍", "👨‍👩‍👧‍👦", "🇯🇵", "e\u0301", "a\u0308\u0323", "👩🏽‍💻", "x\u20dd"], 40),
    "hi.txt": lines(["विशेषज्ञ", "मार्ग", "मॉडल", "भाषा", "डेटा", "का", "है", "।"], 40),
    "ja.txt": lines(["専門家", "ルーティング", "は", "です", "データ", "を", "、", "。"], 40, sep=""),
    "zh.txt": lines(["专家", "路由", "因果", "模型", "文本", "训练", "的", "。", "，"], 40, sep=""),
}


def test_every_script_decodes_back_and_the_split_has_the_manifests_tokens(tmp_path):
    (tmp_path / "texts").mkdir()
    for name, text in TEXTS.items():
        (tmp_path / "texts" / name).write_bytes(text.encode())
    for how in (["--train-tokenizer", "400"], ["--bytes"]):
        out = tmp_path / how[0]
        assert prepare(tmp_path / "texts", "--out", out, *how) == 0
        m = read_manifest(out)
        assert decoded(out) == [TEXTS[name] for name in sorted(TEXTS)]
        tokenizer = load_tokenizer_file(str(out / "tokenizer.json"))
        for text in TEXTS.values():
            assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
        n = m["num_tokens"]
        assert stream(out).size == n and m["num_documents"] == len(TEXTS)
        corpus = load_corpus(str(out))
        train, val = split_ranges(n, 0.1)
        assert corpus.train.numel() + corpus.val.numel() == n and corpus.val.numel() == math.floor(0.1 * n)
        covered = sorted(train + val)
        assert len(val) == 20 and all(a < b for a, b in covered)
        ids = stream(out)
        for part, ranges in ((corpus.train, train), (corpus.val, val)):
            want = np.concatenate([ids[a:b] for a, b in ranges])
            assert part[torch.arange(part.numel())].tolist() == want.tolist()
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # disjoint, no gap
