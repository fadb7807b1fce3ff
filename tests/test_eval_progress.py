"""Evaluation inside ``experiments/train.py`` shows itself (issue 52, item 6): a progress bar of
its forwards on stderr, its own time, and every evaluation's result in a printed line (not only
in the metrics JSONL), whatever ``--log-every`` says."""

import json
import re

from test_nothing_lost import RUN

from moe.training import main


def test_every_evaluation_shows_a_bar_its_time_and_its_result(tmp_path, capsys):
    jsonl = tmp_path / "m.jsonl"
    args = [a for a in RUN if a != "--no-progress"]
    main([*args, "--log-every", "10", "--steps", "3", "--eval-every", "1", "--metrics-jsonl", str(jsonl)])
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [1, 2, 3], captured.out  # --log-every 10 prints step 3 alone
    for line in lines:
        assert re.search(r"\| eval tf \d+\.\d{4} causal \d+\.\d{4} gap \S+ \(\d+\.\d s\)$", line), line
    for step in (1, 2, 3):
        assert f"eval step {step}:" in captured.err, captured.err[-500:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert all(r["eval/time_s"] > 0 for r in records)
