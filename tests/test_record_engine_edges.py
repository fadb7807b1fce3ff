"""Edges of the routing-record checks that the replay tests leave open, each with its expected
answer worked out by hand: ``check_record_fits`` refuses expert id E itself (ids run 0..E-1);
an engine request starting at ``start`` needs a prefix of at least ``start`` positions; int16
engine arrays hold expert ids up to 32767 exactly; a left-padded request longer than the
batch is refused in one line; a record's rows keep their own padding; a record is written from
position 0 for one batch, its ids at least -1; a routing that dropped every token keeps one slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe
from moe.engine_records import from_engine_request, left_padded, to_engine_requests
from moe.record import routing_slots
from moe.record_fit import check_record_fits
from moe.routing import Routing


def one_layer_record(experts_SK: list[list[int]]) -> moe.RoutingRecord:
    """One sequence, one MoE layer: position s routed to ``experts_SK[s]``."""
    experts = torch.tensor(experts_SK, dtype=torch.int32)
    return moe.RoutingRecord(1, experts.view(1, len(experts_SK), 1, -1))


@pytest.mark.parametrize("name", ["topk", "capacity"])
def test_expert_id_e_itself_is_refused(name):
    """E = 4 experts are ids 0..3: a record naming 3 fits, one naming 4 does not."""
    router = moe.build_router(name, d_model=4, num_experts=4, top_k=2)
    check_record_fits(one_layer_record([[0, 3], [1, 2]]).experts, None, [router])
    with pytest.raises(ValueError, match="the record names expert 4"):
        check_record_fits(one_layer_record([[0, 4], [1, 2]]).experts, None, [router])


def test_a_prefix_one_position_short_is_refused():
    """rows start..seq_len-2 come from the engine, 0..start-1 from the prefix: start = 3 needs
    a prefix of 3 positions; one of 2 would leave the rebuilt record a position short."""
    seq_len, start = 6, 3
    tail = np.array([[[1, 2]], [[0, 3]]], dtype=np.int32)  # seq_len - 1 - start = 2 rows
    full_prefix = one_layer_record([[0, 1], [2, 3], [1, 3]])
    rebuilt = from_engine_request(tail, seq_len, start=start, prefix=full_prefix)
    assert rebuilt.experts[0, :, 0].tolist() == [[0, 1], [2, 3], [1, 3], [1, 2], [0, 3]]
    with pytest.raises(ValueError, match="positions 0..2 need the record"):
        from_engine_request(tail, seq_len, start=start, prefix=one_layer_record([[0, 1], [2, 3]]))


def test_int16_holds_expert_ids_up_to_32767():
    """int16's largest value is 32767: an expert id of 32767 fits, 32768 does not."""
    (rows,) = to_engine_requests(one_layer_record([[0, 32767]]), dtype=np.int16)
    assert rows.dtype == np.int16 and rows.tolist() == [[[0, 32767]]]
    with pytest.raises(ValueError, match="expert ids up to 32768 do not fit int16"):
        to_engine_requests(one_layer_record([[0, 32768]]), dtype=np.int16)


def test_a_request_longer_than_the_batch_is_refused():
    """A batch of 3 positions takes requests of 3 rows; one of 4 is refused with a ValueError."""
    three = np.zeros((3, 1, 2), dtype=np.int32)
    assert left_padded([three], 3).experts.shape == (1, 3, 1, 2)
    with pytest.raises(ValueError, match="a request of 4 rows does not fit 3 positions"):
        left_padded([np.zeros((4, 1, 2), dtype=np.int32)], 3)


def test_rows_keep_their_own_padding():
    """A left-padded record of requests of 1 and 3 rows in 3 positions: the first sequence's
    rows carry its two padding positions, the second's none (a microbatch's record replays with
    its own sequences' padding)."""
    record = left_padded([[[[2]]], [[[0]], [[1]], [[3]]]], length=3)
    assert record.padding.tolist() == [[True, True, False], [False, False, False]]
    assert record.rows(0, 1).padding.tolist() == [[True, True, False]]
    assert record.rows(1, 2).padding.tolist() == [[False, False, False]]
    assert record.rows(1, 2).experts[0, :, 0, 0].tolist() == [0, 1, 3]
    assert torch.equal(record.rows(0, 2).padding, record.padding)


def test_a_record_is_written_from_position_0_for_one_batch_and_ids_below_minus_1_are_refused():
    """Position 1 may follow positions 0..0; position 2 may not (a gap). The same layer routing a
    batch of another size (same length) is another batch. -1 marks an empty slot; -2 is no id."""
    record = moe.RoutingRecord(1)
    record.write(0, torch.zeros(2, 1, dtype=torch.long), (2, 1), 0)
    record.write(0, torch.ones(2, 1, dtype=torch.long), (2, 1), 1)
    with pytest.raises(ValueError, match="record holds only 0..1"):
        record.write(0, torch.ones(2, 1, dtype=torch.long), (2, 1), 3)
    with pytest.raises(ValueError, match="it holds 2, a forward routed 3"):
        record.write(0, torch.ones(3, 1, dtype=torch.long), (3, 1), 2)
    assert record.experts[:, :, 0, 0].tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="expert ids must be >= 0, or -1 for an empty slot; got -2"):
        moe.RoutingRecord.from_engine([[[[0, -2]]]])


def test_routing_slots_keep_one_slot_when_every_token_was_dropped():
    empty = torch.zeros(0, dtype=torch.long)
    routing = Routing(empty, empty, torch.zeros(0), num_tokens=3, num_experts=2, aux_loss=torch.zeros(()))
    assert routing_slots(routing).tolist() == [[-1], [-1], [-1]]
