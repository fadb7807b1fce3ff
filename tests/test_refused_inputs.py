"""Small inputs that used to crash or pass silently, each now one clear error (issue 60, item 8):
an empty batch or sequence into any router, token ids outside the vocabulary (the model, and a
prepared corpus whose manifest's vocab_size is too small in the trainer), a vocabulary that 16-bit
shards cannot hold; and NaN scores into ec_threshold, which routed them to no expert (a clean
zero output) and now give NaN as every other router does."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL_RUN

from moe.data import load_corpus
from moe.data.prepare import ShardWriter
from moe.data.shards import FORMAT
from moe.layer import MoELayer
from moe.model import ModelConfig, MoETransformer
from moe.routers import build_router
from moe.routing import registered_routers
from moe.training import TrainConfig, main, train
from moe.training.batches import DataConfig, local_batch


@pytest.mark.parametrize("name", sorted(registered_routers()))
@pytest.mark.parametrize("shape", [(0, 3, 16), (2, 0, 16)])
def test_an_empty_batch_or_sequence_is_one_clear_error_for_every_router(name, shape):
    router = build_router(name, d_model=16, num_experts=4)
    with pytest.raises(ValueError, match=r"at least one sequence of at least one token, got input of shape"):
        router(torch.randn(shape))
    with pytest.raises(ValueError, match=r"at least one sequence of at least one token"):
        MoELayer(16, 32, 4, router=name)(torch.randn(shape))


@pytest.mark.parametrize("bad", [16, -1])
def test_token_ids_outside_the_vocabulary_are_a_clear_error_in_the_model(bad):
    model = MoETransformer(ModelConfig(vocab_size=16, d_model=16, n_heads=2, moe_d_ff=16))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 16\)"):
        model(torch.tensor([[1, 2, bad]]))
    model(torch.tensor([[0, 15]]))  # the edges are inside


def prepared(directory: Path, tokens: np.ndarray, vocab_size: int, dtype: str = "uint16") -> str:
    """A prepared directory written by hand: one shard of ``tokens``, the manifest's ``vocab_size``."""
    directory.mkdir()
    tokens.astype("<u2" if dtype == "uint16" else "<u4").tofile(directory / "s0.bin")
    manifest = {
        "format": FORMAT,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "shards": [{"file": "s0.bin", "num_tokens": int(tokens.size)}],
        "num_tokens": int(tokens.size),
        "tokenizer": "tokenizer.json",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return str(directory)


def test_a_manifest_vocab_size_too_small_is_one_line_in_the_trainer(tmp_path, capsys):
    data = prepared(tmp_path / "d", np.random.default_rng(0).integers(0, 300, 20_000), vocab_size=256)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", data, "--steps", "2", "--seq-len", "32", "--batch-size", "4", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds token id 299, outside its vocabulary of 256" in err, err
    corpus = load_corpus(data)  # a training batch says the same (a raw IndexError before)
    cfg = DataConfig(data=data, seq_len=32, batch_size=4)
    with pytest.raises(ValueError, match="a training batch of .* holds token id 299, outside its vocabulary of 256"):
        local_batch(corpus, cfg, 0, 1, torch.device("cpu"))


def test_a_vocabulary_beyond_16_bit_shards_is_refused_at_writing_and_reading(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 70,000 does not fit uint16 shards .* use uint32"):
        ShardWriter(tmp_path, "uint16", 100, vocab_size=70_000)
    ShardWriter(tmp_path, "uint16", 100, vocab_size=65_536)  # ids 0..65535 fit
    data = prepared(tmp_path / "d", np.arange(1_000), vocab_size=70_000)
    with pytest.raises(ValueError, match="vocab_size 70,000 does not fit uint16 shards"):
        load_corpus(data)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nan_scores_into_ec_threshold_give_nan_not_a_clean_zero_as_with_the_other_routers(mode):
    """A NaN score is below every threshold: the token got no expert and a zero output. Now it
    is NaN, as topk's; with check_finite both raise; and the thresholds survive a NaN step."""
    x_BTD = torch.randn(2, 5, 16)
    x_BTD[1, 3, 7] = float("nan")
    for name in ("ec_threshold", "topk"):
        layer = getattr(MoELayer(16, 32, 4, router=name), mode)()
        y_BTD = layer(x_BTD)
        assert y_BTD[1, 3].isnan().all() and not y_BTD[0].isnan().any(), (name, y_BTD[1, 3])
        checked = MoELayer(16, 32, 4, router=name, check_finite=True)
        with pytest.raises(ValueError, match=r"Router: router logits contain NaN or inf \(input has 1 non-finite"):
            checked(x_BTD)
    router = build_router("ec_threshold", d_model=16, num_experts=4)
    router.train()(torch.randn(2, 5, 16))
    router.update_after_step()
    threshold_E = router.threshold.clone()
    router(torch.full((2, 5, 16), float("nan")))  # every cut-off NaN: this step's statistics are left out
    router.update_after_step()
    assert torch.equal(router.threshold, threshold_E)
    router(x_BTD)  # one NaN token among finite ones: finite cut-offs
    router.update_after_step()
    assert torch.isfinite(router.threshold).all()


def test_the_trainer_runs_a_corpus_whose_ids_fit(tmp_path):
    data = prepared(tmp_path / "d", np.random.default_rng(0).integers(0, 300, 20_000), vocab_size=300)
    small = {k: v for k, v in SMALL_RUN.items() if k != "max_bytes"}
    assert len(train(TrainConfig.flat(data=data, steps=1, **small)).history) == 1
