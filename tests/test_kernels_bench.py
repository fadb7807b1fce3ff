"""The benchmark scripts' CPU dry runs and the GPU check script: they must run end to end, and
report numbers that mean what they say, before a GPU is lent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from extras import needs

ROOT = Path(__file__).resolve().parents[1]
GRADS = {"y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@needs("triton", "triton")
def test_bench_kernels_dry_run_checks_first_and_reports_consistent_numbers(tmp_path, monkeypatch):
    bench = load_script("bench_kernels")
    events: list[str] = []
    check, timer = bench.check_correctness, bench.timer

    def recorded_check(*args):
        report = check(*args)
        events.append("checked")
        return report

    def recorded_timer(device):
        time_ms = timer(device)
        return lambda fn: events.append("timed") or time_ms(fn)

    monkeypatch.setattr(bench, "check_correctness", recorded_check)
    monkeypatch.setattr(bench, "timer", recorded_timer)
    results = bench.main(["--dry-run", "--shapes", "A,decode", "--sets", "2", "--out-dir", str(tmp_path)])
    files = list(tmp_path.glob("bench_kernels-*-cpu-dry-run.json"))
    assert len(files) == 1 and results["path"] == str(files[0])
    saved = json.loads(files[0].read_text())
    assert saved["gpu"] == "cpu-dry-run" and saved["dry_run"] and saved["dtype"] == "torch.float32"

    # Every path is checked against the reference, output and every gradient, before any timing.
    assert events[0] == "checked" and events.count("checked") == 1 and events.count("timed") > 10
    corr = saved["correctness"]
    assert corr["ok"] and set(corr["paths"]) == set(bench.PATHS)
    for path, entry in corr["paths"].items():
        assert "error" not in entry, (path, entry)
        assert set(entry["rel_error"]) == GRADS, path
        assert entry["ok"] and max(entry["rel_error"].values()) <= corr["tolerance_rel"], (path, entry)
    assert corr["paths"]["triton"]["bitwise_reproducible"] and corr["paths"]["grouped_mm"]["bitwise_reproducible"]
    assert set(corr["triton_vs_grouped_mm_rel"]) == GRADS
    assert max(corr["triton_vs_grouped_mm_rel"].values()) <= 2 * corr["tolerance_rel"]

    # The floors are what the timed copy and matmul imply.
    fl = saved["floors"]
    assert fl["copy_bytes"] == 2 * 2**20 * 2  # 1 Mi bf16 elements, read once and written once
    assert fl["hbm_bandwidth_GBps"] == pytest.approx(fl["copy_bytes"] / (fl["copy_ms"] * 1e-3) / 1e9)
    assert fl["matmul_TFLOPs"] == pytest.approx(2 * fl["matmul_size"] ** 3 / (fl["matmul_ms"] * 1e-3) / 1e12)

    assert set(saved["shapes"]) == {"A", "decode"}
    for name, r in saved["shapes"].items():
        shape, ms = bench.DRY_SHAPES[name], r["ms"]
        assert r["shape"] == asdict(shape)
        n, d, f, a = shape.tokens, shape.d_model, shape.d_ff, shape.tokens * shape.top_k
        # dispatch reads N rows and writes A; combine reads A rows and writes N; fp32 rows,
        # plus a 4-byte index, position and weight per assignment.
        min_bytes = 4 * (2 * n * d + 2 * a * d) + 12 * a
        assert r["dispatch_combine_floor_ms"] == pytest.approx(min_bytes / (fl["hbm_bandwidth_GBps"] * 1e9) * 1e3)
        assert r["dispatch_combine_fraction_of_bandwidth"] == pytest.approx(
            r["dispatch_combine_floor_ms"] / (ms["dispatch"] + ms["combine"])
        )
        # Three matmuls of 2*A*D*F FLOPs forward, twice that backward.
        assert r["gemm_floor_fwd_bwd_ms"] == pytest.approx(18 * a * d * f / (fl["matmul_TFLOPs"] * 1e12) * 1e3)
        assert r["layer_fwd_bwd_over_gemm_floor"] == pytest.approx(ms["triton_fwd_bwd"] / r["gemm_floor_fwd_bwd_ms"])
        assert r["speedup_vs_torch_eager"] == pytest.approx(ms["torch_eager_fwd_bwd"] / ms["triton_fwd_bwd"])
        assert r["triton_over_dense_fwd_bwd"] == pytest.approx(ms["triton_fwd_bwd"] / ms["dense_same_flops_fwd_bwd"])
        assert r["triton_over_grouped_mm_fwd_bwd"] == pytest.approx(ms["triton_fwd_bwd"] / ms["grouped_mm_fwd_bwd"])
        for path in bench.PATHS:  # TFLOP/s: the useful FLOPs over the time, forward and forward+backward
            assert r["TFLOPs"][f"{path}_fwd"] == pytest.approx(6 * a * d * f / (ms[f"{path}_fwd"] * 1e9))
            assert r["TFLOPs"][f"{path}_fwd_bwd"] == pytest.approx(18 * a * d * f / (ms[f"{path}_fwd_bwd"] * 1e9))
        for key in ("routing_metadata", "dispatch", "combine", "triton_fwd", "triton_fwd_bwd", "grouped_mm_fwd_bwd"):
            assert ms[key] > 0, key
        for key in (
            "dispatch_combine_fraction_of_bandwidth",
            "layer_fwd_bwd_over_gemm_floor",
            "speedup_vs_torch_eager",
            "triton_over_grouped_mm_fwd_bwd",
        ):
            assert saved[key][name] == r[key], key
    assert saved["goals"]["speedup_vs_torch_eager"]["value"] == saved["shapes"]["A"]["speedup_vs_torch_eager"]
    assert saved["auto_rule"]["triton_over_grouped_mm_fwd_bwd"] == saved["triton_over_grouped_mm_fwd_bwd"]


@needs("triton", "triton")
def test_auto_rule_needs_triton_correct_and_faster_at_every_shape():
    bench = load_script("bench_kernels")
    paths = {"triton": {"ok": True}, "grouped_mm": {"ok": True}}
    shapes = {"B": {"triton_over_grouped_mm_fwd_bwd": 0.8}, "V": {"triton_over_grouped_mm_fwd_bwd": 0.9}}
    results = {"correctness": {"paths": paths}, "shapes": shapes}
    assert bench.judge(results)["auto_rule"]["triton_equal_and_faster"]
    shapes["V"]["triton_over_grouped_mm_fwd_bwd"] = 1.01
    assert not bench.judge(results)["auto_rule"]["triton_equal_and_faster"]
    shapes["V"]["triton_over_grouped_mm_fwd_bwd"] = 0.9
    paths["triton"]["ok"] = False
    assert not bench.judge(results)["auto_rule"]["triton_equal_and_faster"]


def wrong_by(fn, scale):
    return lambda x, *rest: fn(x, *rest) * scale


def not_reproducible(fn):
    calls = iter(range(1000))
    return lambda x, *rest: fn(x, *rest) * (1 + 1e-7 * next(calls))


@needs("triton", "triton")
@pytest.mark.parametrize(
    "path,broken",
    [
        ("triton", lambda fn: wrong_by(fn, 1.001)),
        ("torch_eager", lambda fn: wrong_by(fn, 1.001)),
        ("triton", not_reproducible),
        ("grouped_mm", lambda fn: wrong_by(fn, 1.001)),
        ("grouped_mm", not_reproducible),
    ],
)
def test_correctness_check_catches_a_wrong_path(monkeypatch, path, broken):
    import torch

    bench = load_script("bench_kernels")
    monkeypatch.setitem(bench.PATHS, path, broken(bench.PATHS[path]))
    report = bench.check_correctness(torch.device("cpu"), torch.float32, True)
    assert not report["ok"] and not report["paths"][path]["ok"], report
    others = [p for p, e in report["paths"].items() if p != path and "error" not in e]
    assert others and all(report["paths"][p]["ok"] for p in others), report


@needs("triton", "triton")
def test_bench_kernels_exits_nonzero_when_triton_is_wrong(tmp_path, monkeypatch):
    bench = load_script("bench_kernels")
    monkeypatch.setitem(bench.PATHS, "triton", wrong_by(bench.PATHS["triton"], 1.001))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--shapes", "decode", "--sets", "1", "--out-dir", str(tmp_path)])
    assert exc.value.code == 1
    saved = json.loads(next(tmp_path.glob("bench_kernels-*.json")).read_text())
    assert not saved["correctness"]["ok"] and not saved["correctness"]["paths"]["triton"]["ok"]


@needs("triton", "triton")
def test_bench_kernels_rejects_unknown_shape(tmp_path):
    bench = load_script("bench_kernels")
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--shapes", "Z", "--out-dir", str(tmp_path)])


@needs("triton", "triton")
def test_bench_model_step_dry_run_backends_and_compiled(tmp_path):
    """One router with both backends and compiled (the Triton interpreter takes seconds a step;
    the whole list runs in gpu_check.sh's slow dry run); every registered router has a configuration."""
    import moe

    step = load_script("bench_model_step")
    assert set(moe.list_routers()) <= {router for router, _ in step.ROUTERS.values()}
    argv = ["--dry-run", "--matmul-tflops", "1.0", "--routers", "topk", "--compile-routers", "topk", "--warmup", "0"]
    results = step.main([*argv, "--steps", "1", "--out-dir", str(tmp_path)])
    runs = json.loads(Path(results["path"]).read_text())["runs"]
    assert set(runs) == {"topk grouped_mm", "topk triton", "topk grouped_mm compiled"}
    for key, r in runs.items():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, key
        assert r["assignments_per_token"] == 2, key
        # same weights and batch: the same first loss up to bf16 rounding, whatever the backend or mode
        assert abs(r["first_loss"] - runs["topk grouped_mm"]["first_loss"]) < 5e-3, key


# -- experiments/gpu_check.sh ------------------------------------------------------------

GPU_CHECK = ROOT / "experiments" / "gpu_check.sh"


def run_gpu_check(out: Path, env_extra: dict, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True).returncode == 0


def test_gpu_check_runs_every_step_hands_the_matmul_rate_on_and_reports_failures(tmp_path):
    """Each step's command, as the script runs it, through a stand-in ``timeout`` that records
    its arguments: the kernel benchmark "succeeds" and writes a JSON, the other steps fail."""
    out, fake_bin = tmp_path / "out", tmp_path / "bin"
    fake_bin.mkdir()
    log = tmp_path / "commands.txt"
    (fake_bin / "timeout").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        'case "$*" in *bench_kernels.py*) echo "{}" > "$OUT/bench_kernels-test.json"; exit 0;; esac\n'
        "exit 7\n"
    )
    (fake_bin / "timeout").chmod(0o755)
    proc = run_gpu_check(out, {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DRY_RUN": "1"}, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # five steps failed
    commands = log.read_text().splitlines()
    assert commands == [
        f"120 python -m pytest -q -m gpu tests/ --junitxml {out}/pytest_gpu.xml",
        f"150 python experiments/bench_kernels.py --out-dir {out} --dry-run --shapes A,V,decode --sets 1",
        f"150 python experiments/bench_model_step.py --out-dir {out} --dry-run --routers topk,expert_choice "
        f"--compile-routers topk --bench-json {out}/bench_kernels-test.json",
        "105 python experiments/train.py --preset tiny --device cpu --steps 4 --batch-size 2 --seq-len 32 "
        "--activation-checkpointing selective --eval-windows 2 --eval-batch-size 2 --causal-stride 8 --log-every 2 "
        f"--backend auto --eval-every 0 --metrics-jsonl {out}/train/metrics.jsonl",
        f"30 python experiments/bench_router_gemm.py --out {out} --device cpu --batches 1 --rounds 1",
        f"15 python experiments/gpu_report.py {out}",
    ]
    assert sum(int(c.split()[0]) for c in commands) <= 570, "the steps' timeouts must fit one 10-minute device command"
    names = ("versions", "nvidia-smi", "pytest_gpu", "bench_kernels", "bench_model_step", "train", "bench_router_gemm")
    for name in (*names, "gpu_report"):
        assert (out / f"{name}.txt").exists(), name
    assert "status 1" in proc.stdout


def test_gpu_check_full_commands_without_dry_run(tmp_path):
    out, fake_bin = tmp_path / "out", tmp_path / "bin"
    fake_bin.mkdir()
    log = tmp_path / "commands.txt"
    (fake_bin / "timeout").write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexit 0\n')
    (fake_bin / "timeout").chmod(0o755)
    proc = run_gpu_check(out, {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DRY_RUN": "0"}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().splitlines() == [
        f"120 python -m pytest -q -m gpu tests/ --junitxml {out}/pytest_gpu.xml",
        f"150 python experiments/bench_kernels.py --out-dir {out}",
        f"150 python experiments/bench_model_step.py --out-dir {out}",
        "105 python experiments/train.py --preset gpu100m --steps 30 --batch-size 8 --seq-len 1024 --compile "
        "--activation-checkpointing full --eval-windows 8 --eval-batch-size 8 --causal-stride 128 --log-every 10 "
        f"--backend auto --eval-every 0 --metrics-jsonl {out}/train/metrics.jsonl",
        f"30 python experiments/bench_router_gemm.py --out {out} --device cuda",
        f"15 python experiments/gpu_report.py {out}",
    ]


def test_gpu_report_says_what_is_missing_and_reads_pytest_xml(tmp_path):
    report = load_script("gpu_report")
    (tmp_path / "pytest_gpu.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_x" name="test_a"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_x" name="test_b"/><testcase classname="tests.test_x" name="test_c">'
        "<skipped/></testcase></testsuite></testsuites>"
    )
    r = report.main([str(tmp_path)])
    assert r["pytest_gpu"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1, "failed": ["tests.test_x::test_a"]}
    page = next(tmp_path.glob("gpu_report-*-unknown.md")).read_text()
    assert "1 failed" in page and "tests.test_x::test_a" in page and "Kernel benchmark: missing." in page
    assert "Training run" in page and "missing." in page


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end(tmp_path):
    """The real steps on the CPU (GPU tests skip; the benchmarks' --dry-run): 5-10 minutes loaded."""
    out = tmp_path / "out"
    proc = run_gpu_check(out, {"DRY_RUN": "1"}, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" in (out / "pytest_gpu.txt").read_text()
    (bench_json,) = out.glob("bench_kernels-*-cpu-dry-run.json")
    (step_json,) = out.glob("bench_model_step-*-cpu-dry-run.json")
    bench, step = json.loads(bench_json.read_text()), json.loads(step_json.read_text())
    assert bench["correctness"]["ok"] and set(bench["shapes"]) == {"A", "V", "decode"}
    assert step["matmul_TFLOPs"] == bench["floors"]["matmul_TFLOPs"]  # MFU uses the rate step 2 measured
    assert set(step["runs"]) == {f"{r} {b}" for r in ("topk", "expert_choice") for b in ("grouped_mm", "triton")} | {
        "topk grouped_mm compiled"
    }
    (report_json,) = out.glob("gpu_report-*-cpu-dry-run.json")
    report = json.loads(report_json.read_text())
    assert report["kernels"]["auto_rule"] is not None and report["train"]["steps"] == 4
    assert "eval/causal_loss" in report["train"]
    assert (out / f"{bench_json.stem}-profile-A.txt").exists()
