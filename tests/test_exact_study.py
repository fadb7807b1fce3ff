"""experiments/exact_study.py's pieces: the four trainers against the server on a small model, and
the table written into the docs between its markers."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT, small_lm

sys.path.insert(0, str(ROOT / "experiments"))
import exact_study  # noqa: E402


def test_exact_mode_brings_a_bf16_top_k_trainer_to_the_servers_bits_and_costs_are_ratios():
    model = exact_study.cast_parameters(small_lm("topk", {"top_k": 2}, vocab_size=64).eval(), torch.bfloat16)
    idx_BT = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    row = exact_study.measure(model, idx_BT, repeats=1)
    gaps = row["trainers"]
    assert gaps["as is"]["max"] > 0 and gaps["exact"]["max"] == 0 and gaps["exact + replay"]["max"] == 0
    with torch.no_grad():  # the reference: the served log p by hand, one token at a time through the cache
        cache = model.init_cache(3, 16)
        logits = torch.cat([model(idx_BT[:, t : t + 1], cache=cache).logits.float() for t in range(16)], 1)
        trained = model(idx_BT).logits.float()
    want = (exact_study.next_token_logp(trained, idx_BT) - exact_study.next_token_logp(logits, idx_BT)).abs()
    assert gaps["as is"]["max"] == want.max().item()
    assert gaps["as is"]["cost"] == 1.0 and gaps["exact"]["cost"] > 0
    seconds = row["seconds"]
    want_cost = (seconds["server exact"] + seconds["trainer exact"]) / (seconds["server"] + seconds["trainer"])
    assert gaps["exact"]["cost"] == pytest.approx(want_cost)


def test_the_docs_table_is_replaced_between_its_markers_and_refused_without_them(tmp_path):
    page = tmp_path / "studies.md"
    page.write_text(f"intro\n{exact_study.BEGIN}\nold table\n{exact_study.END}\nafter\n")
    exact_study.replace_docs_table(page, ["| a |", "|---|"])
    assert page.read_text() == f"intro\n{exact_study.BEGIN}\n| a |\n|---|\n{exact_study.END}\nafter\n"
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="has no <!-- exact_study table"):
        exact_study.replace_docs_table(page, ["| a |"])
