"""experiments/router_study.py's registrations and results files (issue 60 item 3): a registered
test never uses rows stored before it was committed (unless an earlier registration that fixed
them is named in ``reuses``); a registration field of the wrong type, and a results JSON that is
empty, truncated or ``{}``, get one line each and change nothing on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from extras import needs
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import router_study as study  # noqa: E402

pytestmark = needs("scipy", "study")

QUICK = ["--quick", "--workers", "1", "--seeds", "0"]


def registration(**changes) -> dict:
    reg = dict(
        seeds=[6, 7],
        baseline="topk_aux",
        challengers=["expert_threshold"],
        size="large",
        corpus="shakespeare-bpe",
        test=study.REGISTERED_TEST,
        alpha=0.05,
    )
    return reg | changes


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"size": "huge"}, "size must be 'baby' or 'large', got 'huge'"),
        ({"challengers": "quantile"}, "challengers must be a list of router labels (of ROUTERS), got 'quantile'"),
        ({"challengers": ["quantile", "nope"]}, "challengers must be a list of router labels"),
        ({"challengers": ["topk_aux"]}, "challengers must be distinct, and other than the baseline"),
        ({"seeds": "6-18"}, "seeds must be a list of integers, got '6-18'"),
        ({"seeds": [6, 6]}, "seeds must be distinct"),
        ({"baseline": ["topk_aux"]}, "baseline must be one of"),
        ({"corpus": "mine"}, "corpus must be a built-in corpus"),
        ({"alpha": "0.05"}, "alpha must be a number in (0, 1), got '0.05'"),
        ({"test": "z-test"}, "test must be 'paired t-test, two-sided, Holm over the challengers'"),
        ({"reuses": {"quantile": "x.json"}}, "reuses must be {arm: path}"),
    ],
)
def test_registration_fields_of_the_wrong_type_get_one_line(changes, message, tmp_path, capsys):
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(registration(**changes)))
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--registered", str(path), "--json", str(tmp_path / "s.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "is empty: restore it"),
        ('{"rows": [{"key": "01', "is not valid JSON (truncated?)"),
        ("{}", "holds no 'rows' list"),
        ("[]", "holds no 'rows' list"),
    ],
)
def test_a_results_json_that_is_empty_truncated_or_empty_gets_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(text)
    for argv in ([*QUICK, "--update", "--json", str(path)], ["--replot", str(path)]):
        with pytest.raises(SystemExit) as exit_info:
            study.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and str(path) in err[0], err
        assert path.read_text() == text  # nothing written over it
    if text == "{}":  # the replot's registrations beside it are read the same way
        (tmp_path / "s_registration.json").write_text(json.dumps(registration(size="huge")))
        path.write_text('{"rows": []}')
        with pytest.raises(SystemExit):
            study.main(["--replot", str(path)])
        assert "size must be 'baby' or 'large', got 'huge'" in capsys.readouterr().err


def git(repo, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def commit(repo, name: str, content: dict) -> str:
    (repo / name).write_text(json.dumps(content))
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", name)
    return git(repo, "rev-parse", "--short", "HEAD")


def test_registered_rows_stored_before_the_registration_was_committed_are_refused(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    monkeypatch.setattr(study, "ROOT", repo)
    explored = commit(repo, "notes.json", {})  # the exploration's rows ran here
    earlier = commit(repo, "first.json", registration())  # registers topk_aux and expert_threshold, seeds 6-7
    first_rows = [{"router": r, "seed": s, "commit": earlier} for r in ("topk_aux", "expert_threshold") for s in (6, 7)]
    study.check_fresh(repo / "first.json", registration(), first_rows)  # its own rows: fine
    commit(repo, "first.json", registration(verdict={"challengers": []}))  # recording the verdict fixes nothing
    assert study.registration_commit(repo / "first.json").startswith(git(repo, "rev-parse", earlier))
    with pytest.raises(study.StudyError, match="1 of its rows were stored before it was committed") as refused:
        study.check_fresh(repo / "first.json", registration(), [{"router": "topk_aux", "seed": 6, "commit": explored}])
    assert f"topk_aux seed 6 (commit {explored})" in str(refused.value)

    factors = registration(
        baseline="expert_threshold", challengers=["topk_lossfree_unnorm"], reuses={"expert_threshold": "first.json"}
    )
    fixed = commit(repo, "factors.json", factors)
    reused = [{"router": "expert_threshold", "seed": s, "commit": earlier} for s in (6, 7)]
    study.check_fresh(
        repo / "factors.json", factors, reused + [{"router": "topk_lossfree_unnorm", "seed": 6, "commit": fixed}]
    )
    with pytest.raises(study.StudyError, match="topk_lossfree_unnorm seed 7 \\(commit " + earlier):
        study.check_fresh(
            repo / "factors.json", factors, [{"router": "topk_lossfree_unnorm", "seed": 7, "commit": earlier}]
        )
    with pytest.raises(study.StudyError, match="2 of its rows were stored before"):  # no reuses: ET's rows are old
        study.check_fresh(repo / "factors.json", {**factors, "reuses": {}}, reused)
    with pytest.raises(study.StudyError, match="first.json did not register topk_lossfree_unnorm"):
        study.check_fresh(repo / "factors.json", {**factors, "reuses": {"topk_lossfree_unnorm": "first.json"}}, [])
    with pytest.raises(study.StudyError, match="did not register expert_threshold"):  # seeds it did not register
        study.check_fresh(repo / "factors.json", {**factors, "seeds": [6, 8]}, reused)


def test_the_study_runs_the_code_of_its_own_tree_whose_commit_its_rows_record(tmp_path):
    # `python experiments/router_study.py` puts the script's folder first on the path, not the tree:
    # without the study's own insert, moe would come from wherever the package is installed
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import router_study, moe; print(moe.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "experiments")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.stdout.strip() == str(ROOT / "moe" / "__init__.py"), done.stderr


def test_every_registration_beside_a_results_file_is_found_by_its_name(tmp_path):
    (tmp_path / "s_registration.json").write_text(json.dumps(registration()))
    (tmp_path / "s_registration_factors.json").write_text(
        json.dumps(registration(baseline="expert_threshold", challengers=["topk_aux"]))
    )
    (tmp_path / "other_registration.json").write_text(json.dumps(registration()))  # another results file's
    found = study.registrations_of(tmp_path / "s.json")
    assert list(found) == ["", "_factors"] and found["_factors"]["baseline"] == "expert_threshold"
