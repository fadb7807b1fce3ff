"""moe.record_fit.check_record_fits counts each token's recorded experts against the router's
rule, checked here token by token: a top-k router routes exactly k per token, so a record that
gives any real token k-1 (one short) or k+1 experts is refused, and padding positions are not
counted; a capacity router routes at most k, so fewer is replayed with a warning."""

import warnings

import pytest
import torch

import moe
from moe.record_fit import check_record_fits

K, E = 3, 6


def slots(filled: list[int]) -> torch.Tensor:
    """[B=1, S, L=1, K+1]: position s lists experts 0..filled[s]-1, then -1."""
    rows = [[e if e < n else -1 for e in range(K + 1)] for n in filled]
    return torch.tensor(rows, dtype=torch.int32).view(1, len(filled), 1, K + 1)


def router(name: str) -> moe.Router:
    return moe.build_router(name, d_model=4, num_experts=E, top_k=K)


@pytest.mark.parametrize("short", [K - 1, K - 2, 0])
def test_exactly_k_refuses_any_token_with_fewer(short):
    check_record_fits(slots([K, K, K]), None, [router("topk")])
    with pytest.raises(ValueError, match="fewer"):
        check_record_fits(slots([K, short, K]), None, [router("topk")])


def test_exactly_k_refuses_a_token_with_one_more():
    with pytest.raises(ValueError, match="gives a token"):
        check_record_fits(slots([K, K + 1]), None, [router("topk")])


def test_padding_positions_are_not_counted():
    padding = torch.tensor([[True, False, False]])
    check_record_fits(slots([0, K, K]), None, [router("topk")], padding)
    with pytest.raises(ValueError, match="fewer"):
        check_record_fits(slots([0, K - 1, K]), None, [router("topk")], padding)


def test_at_most_k_replays_fewer_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_record_fits(slots([K, K - 1, K]), None, [router("capacity")])
    assert any("1 of 3" in str(w.message) for w in caught)
