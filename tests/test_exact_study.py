"""experiments/exact_study.py's pieces: the four trainers against the server on a small model, and
the table written into the docs between its markers."""

from __future__ import annotations

import math
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


def test_costs_divide_by_the_normal_server_and_trainer_and_the_least_run_counts(monkeypatch):
    """measure() with the timings set by hand, in its order of runs (server, trainer, replay;
    without then inside exact mode): 2, 3, 5 and 7, 11, 13 s. Each trainer's cost is its server
    plus itself over the normal pair's 2 + 3 s; in brackets the server over 2 s and the trainer
    over the normal trainer's 3 s. timed() keeps the least of its repeats."""
    clock = iter([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
    monkeypatch.setattr(exact_study, "timed", lambda repeats, fn, *args: (fn(*args), next(clock)))
    model = small_lm("topk", {"top_k": 2}, vocab_size=64).eval()
    idx_BT = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gaps = exact_study.measure(model, idx_BT, repeats=1)["trainers"]
    got = {name: [gaps[name][k] for k in ("cost", "server_cost", "trainer_cost")] for name in exact_study.TRAINERS}
    want = {
        "as is": [1.0, 1.0, 1.0],
        "replay": [(2 + 5) / 5, 1.0, 5 / 3],
        "exact": [(7 + 11) / 5, 7 / 2, 11 / 3],
        "exact + replay": [(7 + 13) / 5, 7 / 2, 13 / 3],
    }
    # one approx per list: pytest 9.2 refuses an approx of a dict of lists
    assert got == {name: pytest.approx(costs, rel=1e-12) for name, costs in want.items()}
    monkeypatch.undo()
    ticks = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])  # runs of 5, 2 and 7 s
    monkeypatch.setattr(exact_study.time, "process_time", lambda: next(ticks))
    assert exact_study.timed(3, lambda v: v, "out") == ("out", 2.0)


def test_next_token_log_probabilities_and_the_compressed_schedule_by_hand():
    """Position t's logits predict token t + 1: for ids (0, 1, 0) under logit rows (0, ln 3),
    (ln 2, 0), (5, -5), log p of id 1 by row 0 is log 3/4 and of id 0 by row 1 log 2/3.
    A row trained 400 steps warms up 100 * 400 // 2000 = 20 of them, the recipe's 5%."""
    logits_BTV = torch.tensor([[[0.0, math.log(3)], [math.log(2), 0.0], [5.0, -5.0]]])
    got = exact_study.next_token_logp(logits_BTV, torch.tensor([[0, 1, 0]]))
    assert got.dtype == torch.float64
    assert got.shape == (1, 2) and got[0].tolist() == pytest.approx([math.log(3 / 4), math.log(2 / 3)], rel=1e-6)
    assert exact_study.schedule(400) == dict(steps=400, warmup_steps=20, eval_windows=8, eval_batch_size=8)
    assert exact_study.schedule(2000)["warmup_steps"] == 100
