"""``moe-audit`` end to end on a target file written by the test: every exit code, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SOURCE_PATH

from moe.audit import cli
from moe.audit.suite import BuiltinTarget
from moe.routers import ExpertChoiceRouter, TopKRouter, build_router
from moe.routing import Claims

TARGETS = textwrap.dedent(
    '''
    from __future__ import annotations

    from dataclasses import dataclass

    import torch
    from torch import nn

    from moe.routing import Claims


    @dataclass
    class Config:
        width: int = 8
        leak: float = 0.0


    class Positionwise(nn.Module):
        def __init__(self, leak=0.0):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 8)
            self.leak = leak

        def forward(self, x):
            return self.lin(x) + self.leak * x.mean(dim=1, keepdim=True)


    class TokenModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50)

        def forward(self, idx):
            h = self.embed(idx)
            return self.head(h.cumsum(dim=1))  # a prefix sum: causal


    class Pooled(nn.Module):
        def forward(self, x):
            return x.mean(dim=1)  # [B, D]: not [B, T, ...]


    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaboom")


    class Split(nn.Module):
        """Returns a dict: logits leak the sequence mean, hidden is causal."""

        def __init__(self, cfg: Config = Config()):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(cfg.width, cfg.width)

        def forward(self, x):
            hidden = self.lin(x)
            return {"hidden": hidden, "logits": hidden + 0.1 * x.mean(dim=1, keepdim=True)}


    class ClaimsALeak(nn.Module):
        """Causal, but claims to leak in eval mode: a claim the audit cannot demonstrate."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @property
        def claims(self) -> Claims:
            return Claims(causal_train=True, causal_eval=False, batch_invariant=True, decode_consistent=True)

        def forward(self, x):
            return self.lin(x)


    causal = Positionwise()
    leaky = Positionwise(leak=0.1)
    pooled = Pooled()
    broken = Broken()
    split = Split()
    claims_a_leak = ClaimsALeak()
    NOT_A_MODULE = 3


    def make_causal():
        return Positionwise()


    def make_from_config():
        return Positionwise(leak=Config(leak=0.1).leak)


    def raising_factory():
        raise ValueError("no such checkpoint")


    def make_token_model():
        return TokenModel()


    class DeclaredBlock(Positionwise):
        """Declares its claims and width as our routers and MoELayer do."""

        claims = Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)
        d_model = 8


    declared = DeclaredBlock()


    def needs_args(x):
        return x


    def returns_int():
        return 3
    '''
)


@pytest.fixture(scope="module")
def target_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("targets") / "targets.py"
    path.write_text(TARGETS)
    return str(path)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(*argv: str) -> int:
    return cli.main(["--no-progress", *argv])


def test_causal_target_exits_0(target_file, capsys):
    assert run("--target", f"{target_file}:causal", "--input", "float:4,16,8") == 0
    out = capsys.readouterr().out
    # One summary: the verdict, batch / decode findings, the evidence and how it was judged; no tables.
    assert out.startswith("causal: no leak found in output [4, 16, 8]\n") and "judged: deterministic regime" in out, out
    assert "  evidence: comparisons per probe (train: random_future 30," in out, out
    assert "max |delta|" not in out and "verdict" not in out, out
    assert (
        run(
            "--target",
            f"{target_file}:causal",
            "--input",
            "float:4,16,8",
            "--modes",
            "eval",
            "--trials",
            "1",
            "--verbose",
        )
        == 0
    )
    verbose = capsys.readouterr().out
    assert "random_future" in verbose and "max |delta|" in verbose, verbose


def test_declared_width_gives_the_default_input(target_file, capsys):
    """--input left out: features of the declared width for any module declaring claims and
    d_model, the way the built-in routers and MoELayer get theirs (float:4,16,8)."""
    assert run("--target", f"{target_file}:declared", "--modes", "eval", "--trials", "1") == 0
    assert "declared: no leak found (claims hold) in output [4, 16, 8]" in capsys.readouterr().out


def test_factory_and_token_input(target_file, capsys):
    assert run("--target", f"{target_file}:make_causal", "--input", "float:2,8,8", "--trials", "1") == 0
    # --input inferred from the nn.Embedding: tokens:4,16,50.
    assert run("--target", f"{target_file}:make_token_model", "--modes", "eval") == 0
    assert "make_token_model: no leak found" in capsys.readouterr().out


def test_leaky_target_exits_1_and_writes_json(target_file, tmp_path, capsys):
    out_json = tmp_path / "audit.json"
    code = run(
        "--target", f"{target_file}:leaky", "--input", "float:4,16,8", "--modes", "eval", "--json", str(out_json)
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "leaky: LEAKS in eval mode" in out
    # The mechanism (probe, positions, the variant that showed it) and what to use instead.
    assert "found by random_future (eval): outputs at positions 0-14 moved (positions > 0 resampled)" in out, out
    # A sequence mean: the Jacobian shows a differentiable path and no forward moved an output
    # without a gradient, so no layer is advised (the causal routers only for a router's softmax).
    assert "mechanism: the output at t reads later inputs through a differentiable path" in out, out
    assert "MoELayer" not in out and "capacity_scope" not in out, out
    (entry,) = json.loads(out_json.read_text())["targets"]
    assert entry["name"] == "leaky" and entry["claimed_causal"] is None
    assert entry["leaks"] is True and entry["leaks_in"] == ["eval"] and entry["batch_invariant"] is True
    assert {p["mode"] for p in entry["probes"]} == {"eval"}
    jac = next(p for p in entry["probes"] if p["name"] == "jacobian")
    assert jac["leaks"] and jac["first_leaking_position"] == 0 and jac["max_abs_delta"] > 0


def test_module_path_target(tmp_path, monkeypatch):
    """pkg.module:name is imported from the working directory."""
    (tmp_path / "audit_cli_target_mod.py").write_text(TARGETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        run("--target", "audit_cli_target_mod:leaky", "--input", "float:2,8,8", "--modes", "train", "--trials", "1")
        == 1
    )


def test_file_target_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """path/to/file.py:name imports its neighbours, as `python path/to/file.py` can, at import and in
    its factory: a file beside nanoGPT's model.py that does `from model import GPT` (it read "cannot
    import ...: No module named ..." before)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "audit_cli_sibling_at_import.py").write_text("from torch import nn\nLayer = nn.Identity\n")
    (tmp_path / "audit_cli_sibling_in_factory.py").write_text("from torch import nn\nWIDTH = 3\n")
    (tmp_path / "target.py").write_text(
        "from audit_cli_sibling_at_import import Layer\n"
        "def build():\n"
        "    from audit_cli_sibling_in_factory import WIDTH\n"
        "    return Layer(WIDTH)\n"
    )
    module, name = cli.load_target(f"{tmp_path / 'target.py'}:build")
    assert name == "build" and isinstance(module, torch.nn.Identity)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target", "no_such_package_xyz.mod:thing"], "cannot import no_such_package_xyz.mod"),
        (["--target", "{file}:missing"], "has no 'missing'; its modules and factories: Broken(), ClaimsALeak()"),
        (["--target", "{file}"], "pkg.module:name or path/to/file.py:name"),
        (["--target", "/no/such/file.py:x"], "does not exist"),
        (["--target", "{file}:NOT_A_MODULE"], "neither an nn.Module nor a factory"),
        (["--target", "{file}:needs_args"], "needs arguments"),
        (["--target", "{file}:returns_int"], "returned int, not an nn.Module"),
        (["--target", "{file}:causal"], "pass --input"),
        (["--target", "{file}:causal", "--input", "float:4,16"], "--input must be"),
        (["--target", "{file}:causal", "--input", "floaty:4,16,8"], "--input must be"),
        (["--target", "{file}:causal", "--input", "float:a,b,c"], "must be integers"),
        (["--target", "{file}:causal", "--input", "float:4,1,8"], "T must be at least 2"),
        (["--target", "{file}:causal", "--input", "float:4,16,5"], "failed on the example"),
        (["--target", "{file}:pooled", "--input", "float:4,16,8"], "needs an output of shape [B, T, ...]"),
        (["--target", "{file}:broken", "--input", "float:4,16,8"], "RuntimeError: kaboom"),
        (["--target", "{file}:raising_factory"], "raised ValueError: no such checkpoint"),
        (["--target", "{file}:split", "--input", "float:4,16,8", "--output", "nope"], "no field 'nope'"),
        (["--target", "{file}:causal", "--input", "float:4,16,8", "--dtype", "fp8"], None),
        (["--output", "logits"], "--output only applies to --target"),
        (["--target", "{file}:causal", "--input", "float:4,16,8", "--modes", "test"], "--modes"),
        (["--target", "{file}:causal", "--input", "float:4,16,8", "--trials", "0"], "--trials"),
        (["--input", "float:4,16,8"], "--input only applies to --target"),
    ],
)
def test_usage_errors_exit_2(target_file, capsys, argv, message):
    """Usage errors and targets that cannot run exit 2 with one line on stderr, no traceback."""
    argv = [a.replace("{file}", target_file) for a in argv]
    if message is None:  # rejected by argparse itself
        with pytest.raises(SystemExit) as exc:
            run(*argv)
        assert exc.value.code == 2
        return
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-audit: error:") and message in err and "Traceback" not in err, err


def test_future_annotations_dataclass_file_and_output_field(target_file, capsys):
    """The file uses `from __future__ import annotations` and a @dataclass (which looks its module
    up in sys.modules); --output picks a field of a dict output."""
    assert run("--target", f"{target_file}:make_from_config", "--input", "float:2,8,8", "--trials", "1") == 1
    assert run("--target", f"{target_file}:split", "--input", "float:2,8,8", "--trials", "1") == 1
    assert run("--target", f"{target_file}:split", "--input", "float:2,8,8", "--trials", "1", "--output", "hidden") == 0
    assert "split: no leak found" in capsys.readouterr().out


def test_claimed_leak_that_is_not_demonstrated_exits_1(target_file, capsys):
    assert run("--target", f"{target_file}:claims_a_leak", "--input", "float:2,8,8", "--trials", "1") == 1
    out = capsys.readouterr().out
    assert (
        "claims_a_leak: no leak found (FALSE CLAIM)" in out
        and "FALSE CLAIM: claims a leak in eval mode; none found" in out
    )


def test_dtype_and_device(target_file, capsys):
    assert run("--target", f"{target_file}:causal", "--input", "float:2,8,8", "--trials", "1", "--dtype", "bf16") == 0
    assert run("--target", f"{target_file}:leaky", "--input", "float:2,8,8", "--trials", "1", "--dtype", "bf16") == 1
    if not torch.cuda.is_available():
        assert run("--target", f"{target_file}:causal", "--input", "float:2,8,8", "--device", "cuda") == 2
        assert "CUDA is not available" in capsys.readouterr().err


class _LyingRouter(ExpertChoiceRouter):
    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=True, batch_invariant=True)


class _PessimisticTopK(TopKRouter):
    """Dropless top-k (causal) claiming to leak in eval mode: a claim the audit cannot show."""

    @property
    def claims(self) -> Claims:
        return Claims(causal_train=True, causal_eval=False, batch_invariant=True, decode_consistent=True)


def _suite(extra: str | None):
    def example():
        return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))

    def honest():
        torch.manual_seed(0)
        return build_router("topk", d_model=32, num_experts=4)

    def liar():
        torch.manual_seed(0)
        return _LyingRouter(32, 4)

    def pessimist():
        torch.manual_seed(0)
        return _PessimisticTopK(32, 4)

    targets = [BuiltinTarget("router topk", honest, example)]
    if extra == "lying":
        targets.append(BuiltinTarget("router lying expert_choice", liar, example))
    if extra == "pessimistic":
        targets.append(BuiltinTarget("router pessimistic topk", pessimist, example))
    return lambda seed=0: targets


@pytest.mark.parametrize("extra, code", [(None, 0), ("lying", 1), ("pessimistic", 1)])
def test_no_argument_run_checks_claims_both_ways(monkeypatch, capsys, tmp_path, extra, code):
    """The built-in suite itself is audited in tests/test_audit.py; here the command's plumbing
    runs on a stand-in: honest, plus one target claiming a causality it lacks or a leak it does
    not have. Both are false claims."""
    monkeypatch.setattr(cli, "builtin_targets", _suite(extra))
    out_json = tmp_path / "suite.json"
    assert run("--json", str(out_json)) == code
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["target", "causal", "claim"]
    assert "claims hold" in out and "? = it claims" in out and " ok " not in out, out
    assert (
        "router topk" in out and ("FALSE CLAIMS" in out) == bool(extra) and ("every claim holds" in out) != bool(extra)
    )
    if extra == "pessimistic":
        assert "router pessimistic topk: claims a leak in eval mode; none found" in out
    targets = json.loads(out_json.read_text())["targets"]
    assert [t["claims_hold"] for t in targets] == [True] + [False] * bool(extra)
    assert [t["leaks"] for t in targets] == [False, extra == "lying"][: len(targets)]
    assert torch.get_num_threads() == 1, "the built-in suite runs single-threaded by default"


def test_mistyped_name_lists_modules_and_factories_not_imports(target_file, capsys):
    assert run("--target", f"{target_file}:caual") == 2
    err = capsys.readouterr().err
    listed = err.split("its modules and factories: ")[1].strip().split(", ")
    assert "causal" in listed and "make_causal()" in listed and "Positionwise()" in listed, err
    assert not {"torch", "nn", "dataclass", "Claims", "needs_args()"} & set(listed), err


def test_summary_table_fits_100_columns():
    from moe.audit import AuditReport, builtin_targets, summary_table

    claims = Claims(causal_train=False, causal_eval=True, batch_invariant=False, decode_consistent=False)
    reports = [AuditReport(name=bt.name, modes=("train", "eval"), claims=claims) for bt in builtin_targets()]
    for r in reports:
        r.error = "x"  # the widest verdict
    lines = summary_table(reports).splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)


def test_decode_inconsistency_is_not_printed_as_a_leak(capsys):
    """Capacity per sequence in position order: causal, but its capacity depends on T."""
    from moe.audit import audit

    torch.manual_seed(0)
    router = build_router("capacity", d_model=32, num_experts=4, capacity_factor=1.0, priority="position")
    report = audit(router, torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0)), modes=("eval",))
    assert not report.leaks and not report.decode_consistent, report.table()
    assert "DIFFERS" in report.table() and "LEAKS" not in report.table(), report.table()
    assert max(len(line) for line in report.table().splitlines()[1:]) <= 100, report.table()
    assert "decode-consistent: no: prefix-only forwards differ" in report.summary() and "not a leak" in report.summary()


def test_python_dash_m_end_to_end(target_file):
    """`python -m moe.audit` in a fresh interpreter: table on stdout, exit code 1 for a leak."""
    env = {**os.environ, "PYTHONPATH": SOURCE_PATH}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe.audit",
            "--target",
            f"{target_file}:leaky",
            "--input",
            "float:2,8,8",
            "--modes",
            "eval",
            "--trials",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "leaky: LEAKS in eval mode" in proc.stdout


def test_an_output_that_breaks_the_shape_contract_is_said_so_not_blamed_on_the_target(target_file, capsys):
    assert run("--target", f"{target_file}:pooled", "--input", "float:4,16,8") == 2
    err = capsys.readouterr().err
    assert "pooled: NOT AUDITED: its output breaks the audit's contract on the example in train mode" in err, err
    assert "the target failed" not in err and "raised at" not in err, err  # no file:line inside the package
