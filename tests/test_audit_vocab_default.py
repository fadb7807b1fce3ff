"""The id range the audit resamples for a token target that holds no ``nn.Embedding`` and is
given no ``vocab_size``: the example's largest id + 1 (``audit``'s docstring), so that id is
still the largest put in a future and drawn."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.audit import audit


def prefix_counts(ids_BT: torch.Tensor) -> torch.Tensor:
    """Causal: per position, how often each of 16 ids occurred up to it."""
    return F.one_hot(ids_BT, 16).float().cumsum(1)


def test_without_an_embedding_the_largest_id_is_the_examples_largest():
    example = torch.tensor([[0, 3, 7, 2, 5, 1]])
    report = audit(prefix_counts, example, modes=("eval",), quick=True, agreement=False)
    assert not report.leaks
    assert report.ids_tried["largest"] == [7] and report.ids_tried["smallest"] == [0]
