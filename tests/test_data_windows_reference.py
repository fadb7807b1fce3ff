"""Training batches, evaluation windows and the train/validation split (moe/data) against
brute-force references: every valid training start can be drawn and no invalid one, the
evaluation windows are as many non-overlapping windows of seq_len + 1 tokens as the split holds
and never read past it, distinct (seed, step) draw distinct batches, and the split's validation
part is the documented count of tokens at the ends of equal segments, disjoint from training."""

from __future__ import annotations

import math

import pytest
import torch

from moe.data import batch_offsets, eval_offsets, split
from moe.data.corpus import split_ranges


def test_every_valid_training_start_is_drawn_and_none_past_the_end():
    """A window reads tokens o..o+T (inputs and the next-token target): valid starts are
    0..N-T-1. Over many (seed, step) all of them come up, and nothing else."""
    for num_tokens, seq_len in ((10, 4), (6, 5), (33, 8)):
        seen = set()
        for seed in range(6):
            for step in range(60):
                seen |= set(batch_offsets(num_tokens, seq_len, 8, seed, step).tolist())
        assert seen == set(range(num_tokens - seq_len)), (num_tokens, seq_len)


def test_distinct_seeds_and_steps_draw_distinct_batches():
    """A batch is a function of (seed, step): no run's step repeats another seed's step."""
    drawn = {}
    for seed in range(5):
        for step in range(40):
            key = tuple(batch_offsets(1_000_000, 16, 8, seed, step).tolist())
            assert key not in drawn, f"seed {seed} step {step} repeats {drawn.get(key)}"
            drawn[key] = (seed, step)


def reference_available(num_tokens: int, seq_len: int) -> int:
    """The most windows of seq_len + 1 tokens, starting seq_len apart, that fit num_tokens."""
    k = 0
    while (k + 1) * seq_len + 1 <= num_tokens:
        k += 1
    return k


@pytest.mark.parametrize("seq_len", [1, 3, 8])
def test_evaluation_windows_fit_the_split_and_do_not_overlap(seq_len):
    for num_tokens in range(seq_len + 1, 6 * seq_len + 3):
        available = reference_available(num_tokens, seq_len)
        for w in range(1, available + 1):
            o = eval_offsets(num_tokens, seq_len, w).tolist()
            assert len(o) == w and o == sorted(o)
            assert o[0] >= 0 and o[-1] + seq_len + 1 <= num_tokens, (num_tokens, w, o)  # never reads past the end
            assert all(b - a >= seq_len for a, b in zip(o, o[1:])), (num_tokens, w, o)  # inputs disjoint
        with pytest.raises(ValueError, match="non-overlapping windows"):
            eval_offsets(num_tokens, seq_len, available + 1)


def reference_split(n: int, val_fraction: float, segments: int = 20) -> tuple[list[int], list[int]]:
    """From the docstring: N_val = max(1, floor(n f)) validation tokens, at the ends of
    min(20, N_val) equal segments, the k-th taking its share of a cumulative, telescoping count."""
    n_val = max(1, math.floor(n * val_fraction))
    s = min(segments, n_val)
    val = []
    for k in range(s):
        end = (k + 1) * n // s
        take = (k + 1) * n_val // s - k * n_val // s
        val += list(range(end - take, end))
    return [i for i in range(n) if i not in set(val)], val


@pytest.mark.parametrize("n", [7, 25, 41, 99, 1000, 1237])
@pytest.mark.parametrize("val_fraction", [0.05, 0.1, 0.3, 0.5])
def test_the_validation_part_is_the_documented_count_disjoint_from_training(n, val_fraction):
    train, val = split(torch.arange(n), val_fraction)
    want_train, want_val = reference_split(n, val_fraction)
    assert val.numel() == max(1, math.floor(n * val_fraction))
    assert val.tolist() == want_val and train.tolist() == want_train
    assert not set(val.tolist()) & set(train.tolist())
    tr, va = split_ranges(n, val_fraction)
    covered = sorted(i for a, b in tr + va for i in range(a, b))
    assert covered == list(range(n))  # every token in exactly one part
