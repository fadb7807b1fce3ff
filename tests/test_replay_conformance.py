"""Replay conformance (issue 56, item 3): one test per edge an engine or trainer has hit, each
replaying a record made by another path (KV-cache decoding standing in for the engine) and
checking, token by token, that every replayed (token, expert) pair is the one recorded for that
token, or that the record is refused in one line."""

from __future__ import annotations

import base64
import copy
import math
import struct

import numpy as np
import pytest
import torch
from helpers import small_lm

import moe
from moe.engine_records import (
    from_engine_request,
    from_hf_routing,
    from_sglang_base64,
    left_padded,
    to_engine_requests,
    to_hf_routing,
    to_sglang_base64,
)
from moe.layer import MoELayer
from moe.record import RoutingRecord, routing_slots

V = 32


def generated(model, batch=2, prompt=5, new=6, seed=0):
    """(seq_BS, record): a sampled generation through the KV cache and its routing (S - 1 positions)."""
    prompt_BT = torch.randint(0, V, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), moe.record_routing(model) as record:
        seq_BS = model.generate(prompt_BT, new, temperature=1.0, seed=seed)
    return seq_BS, record


def replayed_pairs(model, record, idx_BT, draft=None) -> list[set]:
    """Per MoE layer, the (token, expert) pairs a forward of idx_BT routes while replaying record."""
    with torch.no_grad(), moe.replay_routing(model, record, draft=draft):
        out = model(idx_BT)
    return [pairs_of(r) for r in out.routings[: record.num_layers]]


def pairs_of(routing) -> set:
    kept = routing.compact()
    return set(zip(kept.token.tolist(), kept.expert.tolist()))


def record_pairs(experts_BSLK: torch.Tensor, layer: int) -> set:
    b, s = experts_BSLK.shape[:2]
    return {(i * s + t, int(e)) for i in range(b) for t in range(s) for e in experts_BSLK[i, t, layer] if e >= 0}


def assert_replays(model, record, idx_BT, draft=None) -> None:
    for layer, got in enumerate(replayed_pairs(model, record, idx_BT, draft)):
        assert got == record_pairs(record.experts, layer), f"layer {layer}"


def test_engine_arrays_of_seq_len_minus_1_rows_replay_the_generation():
    model = small_lm("topk", {"top_k": 2}).eval()
    seq_BS, record = generated(model)
    arrays = to_engine_requests(record)  # what vLLM / SGLang / TensorRT-LLM return per request
    assert [a.shape for a in arrays] == [(seq_BS.shape[1] - 1, 2, 2)] * 2 and arrays[0].dtype == np.int32
    requests = [from_engine_request(a, seq_len=seq_BS.shape[1]) for a in arrays]
    rebuilt = RoutingRecord.from_engine([r.experts[0] for r in requests])
    assert torch.equal(rebuilt.experts, record.experts)
    assert_replays(model, rebuilt, seq_BS[:, :-1])  # the training forward: the last token is not forwarded
    with pytest.raises(ValueError, match=r"\[seq_len - 1 - start, layers, top_k\] = \[10, L, K\] rows"):
        from_engine_request(np.concatenate([arrays[0], arrays[0][-1:]]), seq_len=seq_BS.shape[1])


def test_the_minus_1_sentinel_replays_as_no_expert():
    options = {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"}  # drops while decoding
    model = small_lm("capacity", options).eval()
    seq_BS, record = generated(model)
    arrays = to_engine_requests(record)
    assert any((a == -1).any() for a in arrays), "the capacity should have dropped slots"
    with pytest.warns(UserWarning, match="capacity drops or null choices"):
        assert_replays(model, RoutingRecord.from_engine(arrays), seq_BS[:, :-1])


def test_sglang_start_len_rows_replay_with_the_prefix_routed_elsewhere():
    model = small_lm("ec_threshold", {}).eval()
    seq_BS, record = generated(model, batch=1)
    start, seq_len = 4, seq_BS.shape[1]
    tail = to_engine_requests(record, start=start)[0]  # only rows start..seq_len-2 returned
    assert tail.shape[0] == seq_len - 1 - start
    prefix = RoutingRecord(record.num_layers, record.experts[:, :start], record.num_experts)
    rebuilt = from_engine_request(tail, seq_len, start=start, prefix=prefix)
    assert torch.equal(rebuilt.experts[..., : record.slots], record.experts)
    assert_replays(model, rebuilt, seq_BS[:, :-1])
    with pytest.raises(ValueError, match="positions 0..3 need the record of the forward that routed them"):
        from_engine_request(tail, seq_len, start=start)


def test_sglang_base64_text_round_trips_and_replays():
    model = small_lm("capacity", {"top_k": 2, "capacity_factor": 0.5, "capacity_scope": "prefix"}).eval()
    seq_BS, record = generated(model)
    seq_len, layers, k = seq_BS.shape[1], record.num_layers, record.slots
    texts = to_sglang_base64(record)
    for b, text in enumerate(texts):  # the reference: each id packed by hand, little-endian int32, row-major
        ids = [int(e) for e in record.experts[b].flatten()]
        assert text == base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
        assert len(text) == 4 * math.ceil(4 * layers * k * (seq_len - 1) / 3)  # the documented size
    rebuilt = RoutingRecord.from_engine([from_sglang_base64(t, seq_len, layers, k).experts[0] for t in texts])
    assert torch.equal(rebuilt.experts, record.experts) and (rebuilt.experts == -1).any()
    with pytest.warns(UserWarning, match="capacity drops or null choices"):
        assert_replays(model, rebuilt, seq_BS[:, :-1])
    start = 3  # with routed_experts_start_len: the prompt's rows come from the prefix's record
    tail = to_sglang_base64(record.rows(0, 1), start=start)[0]
    prefix = RoutingRecord(layers, record.experts[:1, :start], record.num_experts)
    got = from_sglang_base64(tail.encode(), seq_len, layers, k, start=start, prefix=prefix)
    assert torch.equal(got.experts, record.experts[:1])


@pytest.mark.parametrize(
    ("text", "layers", "top_k", "message"),
    [
        ("not base64!", 2, 2, "SGLang routed_experts is not base64 text"),
        (None, 2, 3, "holds 160 bytes, not whole rows of 2 layers x top_k 3 int32 .24 bytes.: wrong num_layers"),
        (None, 1, 2, r"\[seq_len - 1 - start, layers, top_k\] = \[10, L, K\] rows for seq_len=11"),
        (None, 2, 0, "top_k must be a positive integer, got 0"),
    ],
)
def test_sglang_base64_text_that_does_not_fit_is_refused_in_one_line(text, layers, top_k, message):
    rows = np.arange(10 * 2 * 2, dtype=np.int32).reshape(10, 2, 2) % 4  # a request of seq_len 11, L 2, K 2
    text = text or base64.b64encode(rows.tobytes()).decode()
    with pytest.raises(ValueError, match=message) as refused:
        from_sglang_base64(text, 11, layers, top_k)
    assert "\n" not in str(refused.value)


def test_hugging_face_moe_routing_is_read_and_written():
    model = small_lm("topk", {"top_k": 2}).eval()
    seq_BS, record = generated(model)
    written = to_hf_routing(record)
    selected = getattr(written, "selected_experts", written)
    assert len(selected) == 2 and selected[0].dtype == torch.int64
    assert selected[0].shape == (2 * (seq_BS.shape[1] - 1), 2)  # [B*S, top_k], row b*S + s
    assert torch.equal(selected[1][seq_BS.shape[1] - 1], record.experts[1, 0, 1].long())
    for form in (written, {layer: t for layer, t in enumerate(selected)}):
        read = from_hf_routing(form, batch_size=2)
        assert torch.equal(read.experts, record.experts)
    assert_replays(model, from_hf_routing(written, batch_size=2), seq_BS[:, :-1])
    with pytest.raises(ValueError, match="do not divide into batch_size=3"):
        from_hf_routing(written, batch_size=3)


class WithDraft(torch.nn.Module):
    """A target model and a multi-token-prediction head with an MoE layer of its own, run after it."""

    def __init__(self) -> None:
        super().__init__()
        self.target = small_lm("topk", {"top_k": 2}).eval()
        self.mtp = MoELayer(16, 16, 4, router="topk", top_k=1)

    def forward(self, idx_BT):
        out = self.target(idx_BT)
        self.mtp(torch.randn(idx_BT.shape[0], idx_BT.shape[1], 16))  # the draft routes the same positions
        return out


def test_a_draft_layer_is_kept_out_of_the_targets_record():
    model = WithDraft().eval()
    idx_BT = torch.randint(0, V, (2, 7))
    with torch.no_grad(), moe.record_routing(model, draft=model.mtp) as record:
        out = model(idx_BT)
    assert record.num_layers == 2  # the target's layers only: the draft did not write over layer 0
    for layer, routing in enumerate(out.routings):
        assert torch.equal(record.experts[:, :, layer].reshape(14, -1).long(), routing_slots(routing)), layer
    assert_replays(model, record, idx_BT, draft=model.mtp)
    with pytest.raises(ValueError, match="the record holds 2 MoE layers, the model has 3"):
        moe.replay_routing(model, record).__enter__()


def test_a_cached_prefix_is_replayed_without_recomputing_it():
    model = small_lm("ec_threshold", {}).eval()
    idx_BT = torch.randint(0, V, (2, 9))
    cache = model.init_cache(2, 9)
    with torch.no_grad(), moe.record_routing(model) as prefix:
        model(idx_BT[:, :5], cache=cache)  # the prompt, prefilled once (an engine's prefix cache)
    with torch.no_grad(), moe.record_routing(model, prefix=prefix) as record:
        for t in range(5, 9):  # the continuation, from the cache: the prefix is not forwarded again
            model(idx_BT[:, t : t + 1], cache=cache)
    assert record.length == 9 and torch.equal(record.experts[:, :5], prefix.experts)
    assert_replays(model, record, idx_BT)


def test_replay_under_activation_recompute_gives_the_gradients_of_plain_replay():
    from moe.parallel.recompute import apply_activation_checkpointing

    model = small_lm("topk", {"top_k": 2}, torch.float64)
    seq_BS, record = generated(model.eval())
    engine = RoutingRecord.from_engine(to_engine_requests(record))
    grads = []
    for mode in ("none", "full"):
        trained = copy.deepcopy(model).train()
        apply_activation_checkpointing(trained.blocks, mode)
        with moe.replay_routing(trained, engine):  # the backward reruns the blocks inside the replay
            out = trained(seq_BS[:, :-1], seq_BS[:, 1:])
            (out.loss + out.aux_loss).backward()
        grads.append([p.grad for p in trained.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_left_padding_keeps_every_replayed_expert_with_its_token(tmp_path):
    model = small_lm("topk", {"top_k": 2}).eval()
    (short, rec_short), (long, rec_long) = generated(model, 1, 3, 4, seed=1), generated(model, 1, 5, 4, seed=2)
    length = long.shape[1] - 1
    record = left_padded(to_engine_requests(rec_short) + to_engine_requests(rec_long), length)
    pad = length - (short.shape[1] - 1)
    idx_BT = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), short[0, :-1]]), long[0, :-1]])
    got = replayed_pairs(model, record, idx_BT)
    for layer in range(2):
        want_short = {(pad + t, e) for t, e in record_pairs(rec_short.experts, layer)}
        want_long = {(length + t, e) for t, e in record_pairs(rec_long.experts, layer)}
        assert got[layer] == want_short | want_long, f"layer {layer}"
    assert record.padding[0, :pad].all() and not record.padding[0, pad:].any() and not record.padding[1].any()
    record.save(tmp_path / "padded.npz")
    assert torch.equal(moe.RoutingRecord.load(tmp_path / "padded.npz").padding, record.padding)


def test_a_position_routed_twice_keeps_its_later_routing_even_with_fewer_experts():
    model = small_lm("topk", {"top_k": 2, "null_experts": 2}).eval()
    idx_BT = torch.randint(0, V, (2, 6))
    with torch.no_grad(), moe.record_routing(model) as record:
        first = model(idx_BT)
        for router in model.routers():
            router.null_gate.weight.mul_(-1e3).add_(1e3)  # null experts now win: fewer real experts
        later = model(idx_BT[:, :4])  # positions 0..3 routed again
    for layer, routing in enumerate(later.routings):
        earlier = (routing_slots(first.routings[layer]).view(2, 6, -1)[:, :4] >= 0).sum()
        assert (routing_slots(routing) >= 0).sum() < earlier, "the later pass should pick fewer experts"
        slots = routing_slots(routing).view(2, 4, -1)
        k = slots.shape[-1]
        assert torch.equal(record.experts[:, :4, layer, :k].long(), slots), layer
        assert (record.experts[:, :4, layer, k:] == -1).all(), "a later pass with fewer experts clears the others"
    assert record.length == 6 and (record.experts[:, 4:] >= 0).any()
