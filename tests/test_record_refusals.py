"""A routing record that does not fit the model is refused in one line naming what does not fit
(issue 60, item 4), on the user's path: record, save, load, replay, forward. Where a mismatch is
legitimate (a capacity that dropped slots) the replay goes ahead and says so."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import small_lm

import moe
from moe.model import MoETransformer

V = 32


def recorded(tmp_path, router="topk", options=None, batch=2, **config):
    """The path of a saved record of one forward of a small model."""
    model = small_lm(router, {"top_k": 2} if options is None else options, **config).eval()
    with torch.no_grad(), moe.record_routing(model) as record:
        model(torch.randint(0, V, (batch, 6), generator=torch.Generator().manual_seed(0)))
    path = tmp_path / "record.npz"
    record.save(path)
    return path


def replay_into(model, path):
    record = moe.RoutingRecord.load(path)
    with torch.no_grad(), moe.replay_routing(model, record):
        return model(torch.randint(0, V, (record.batch_size, record.length))).logits


@pytest.mark.parametrize(
    ("made", "into", "message"),
    [
        (
            {"top_k": 1},
            {"top_k": 2},
            r"routes exactly 2 per token; 12 of 12 recorded tokens have fewer \(as few as 1\)",
        ),
        ({"top_k": 4}, {"top_k": 2}, "routes exactly 2 per token; the record gives a token 4"),
        ({"top_k": 2}, {"top_k": 1}, "routes exactly 1 per token; the record gives a token 2"),
        ({"top_k": 2}, {"top_k": 1}, r"MoE layer 0 \('topk', 4 experts\)"),
    ],
)
def test_a_record_of_another_top_k_is_refused(tmp_path, made, into, message):
    path = recorded(tmp_path, options=made)
    with pytest.raises(ValueError, match=message):
        replay_into(small_lm("topk", into).eval(), path)


def test_a_record_of_a_model_with_fewer_experts_is_refused(tmp_path):
    path = recorded(tmp_path)  # 4 experts: every id it names exists in an 8-expert model too
    cfg = replace(small_lm("topk", {}).cfg, num_experts=8, router_options={"top_k": 2})
    eight_experts = MoETransformer(cfg).eval()
    with pytest.raises(ValueError, match=r"8 experts\): the record was made by a model with 4 experts there"):
        replay_into(eight_experts, path)


def test_a_duplicated_expert_in_one_tokens_slots_is_refused(tmp_path):
    experts_SLK = np.tile(np.array([0, 1], dtype=np.int32), (6, 2, 1))
    experts_SLK[4, 1] = [3, 3]
    path = tmp_path / "engine.npy"
    np.save(path, experts_SLK)
    with pytest.raises(ValueError, match="MoE layer 1 .*: sequence 0, position 4 lists expert 3 twice"):
        replay_into(small_lm("topk", {"top_k": 2}).eval(), path)


@pytest.mark.parametrize("dropped", ["seq1", "seq2"])
def test_a_file_with_a_sequence_missing_is_refused(tmp_path, dropped):
    path = recorded(tmp_path, batch=3)
    with np.load(path) as f:
        kept = {n: f[n] for n in f.files if n != dropped}
    np.savez(path, **kept)
    with pytest.raises(ValueError, match="record.npz: a sequence is missing: it should hold seq0..seq2, it holds"):
        moe.RoutingRecord.load(path)


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_an_empty_or_truncated_file_names_the_file(tmp_path, damage):
    path = recorded(tmp_path)
    data = path.read_bytes()
    path.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"record.npz is not a readable routing record \(empty or truncated\?\)"):
        moe.RoutingRecord.load(path)


def test_a_capacity_record_with_dropped_slots_replays_and_says_so(tmp_path):
    options = {"top_k": 2, "capacity_factor": 0.5}
    path = recorded(tmp_path, router="capacity", options=options)
    model = small_lm("capacity", options).eval()
    with pytest.warns(UserWarning, match=r"fewer recorded experts than top_k \(layer 0: \d+ of 12; layer 1"):
        replay_into(model, path)


def test_a_record_that_fits_replays_without_a_word(tmp_path):
    path = recorded(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits = replay_into(small_lm("topk", {"top_k": 2}).eval(), path)
    assert logits.shape == (2, 6, V)
