"""experiments/rows.py, the studies' one row runner: keys, what is pending, how reruns merge
into stored rows, rows run in this process or in spawned ones, and a row's provenance."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
from helpers import ROOT

from experiments import rows


def test_config_key_is_the_hash_the_stored_rows_were_keyed_by():
    what = {"seed": 6, "router": "topk_aux", "fields": {"lr": 1e-3, "data": "shakespeare-bpe"}}
    # router_study.py's key before the runner: SHA-1 of the JSON with sorted keys, 16 hex digits
    want = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    assert rows.config_key(what) == want
    assert rows.config_key(dict(reversed(what.items()))) == want  # the order of the fields does not count
    assert rows.config_key({**what, "seed": 7}) != want


def test_pending_keeps_the_specs_no_stored_row_has_in_their_order():
    key = lambda r: (r["router"], r["seed"])  # noqa: E731
    specs = [{"router": r, "seed": s} for s in (0, 1) for r in ("a", "b")]
    stored = [{"router": "b", "seed": 0, "loss": 1.0}, {"router": "a", "seed": 1, "loss": 2.0}]
    assert rows.pending(specs, stored, key) == [{"router": "a", "seed": 0}, {"router": "b", "seed": 1}]
    assert rows.pending(specs, [], key) == specs


def test_merge_keeps_a_keys_first_place_and_its_last_row():
    key = lambda r: r["k"]  # noqa: E731
    stored = [{"k": 1, "v": "old"}, {"k": 2, "v": "old"}, {"k": 3, "v": "old"}]
    fresh = [{"k": 4, "v": "new"}, {"k": 2, "v": "new"}]
    again = [{"k": 2, "v": "newer"}]
    assert rows.merge(stored, fresh, again, key=key) == [
        {"k": 1, "v": "old"},
        {"k": 2, "v": "newer"},
        {"k": 3, "v": "old"},
        {"k": 4, "v": "new"},
    ]


def test_run_rows_in_this_process_runs_in_order_and_stores_each_row():
    seen = []
    rows.run_rows(lambda spec: {**spec, "done": True}, [{"i": 0}, {"i": 1}], 0, seen.append)
    assert seen == [{"i": 0, "done": True}, {"i": 1, "done": True}]

    def failing(spec: dict) -> dict:
        raise ValueError(f"row {spec['i']} cannot run")

    with pytest.raises(ValueError, match="row 0 cannot run"):
        rows.run_rows(failing, [{"i": 0}], 0, seen.append)


def test_run_rows_in_spawned_processes_stores_every_row_once():
    seen = []
    specs = [{"i": i} for i in range(5)]
    rows.run_rows(dict, specs, 2, seen.append)  # dict(spec): a copy, made in a worker process
    assert sorted(r["i"] for r in seen) == list(range(5))


def test_provenance_names_this_checkout_the_machine_the_command_and_the_date():
    cmd = rows.command("experiments/router_study.py", ["--json", "a b.json"])
    assert cmd == "python experiments/router_study.py --json 'a b.json'"
    ran = rows.provenance(cmd)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert ran["commit"] == head.stdout.strip() and ran["command"] == cmd
    assert set(ran["machine"]) == {"cpu", "cpu_capability", "torch", "threads"}
    assert len(ran["date"]) == 10 and ran["date"][4] == "-"
