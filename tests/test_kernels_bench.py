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
        if "error" in entry:  # only a baseline this torch lacks may be missing
            assert path == "torch_grouped_mm", entry
            continue
        assert set(entry["rel_error"]) == GRADS, path
        assert entry["ok"] and max(entry["rel_error"].values()) <= corr["tolerance_rel"], (path, entry)
    assert corr["paths"]["triton"]["bitwise_reproducible"]

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
        for key in ("routing_metadata", "dispatch", "combine", "triton_fwd", "triton_fwd_bwd", "torch_eager_fwd_bwd"):
            assert ms[key] > 0, key
        for key in (
            "dispatch_combine_fraction_of_bandwidth",
            "layer_fwd_bwd_over_gemm_floor",
            "speedup_vs_torch_eager",
        ):
            assert saved[key][name] == r[key], key


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


def test_bench_model_step_dry_run_every_router(tmp_path):
    step = load_script("bench_model_step")
    results = step.main(["--dry-run", "--matmul-tflops", "1.0", "--out-dir", str(tmp_path)])
    saved = json.loads(Path(results["path"]).read_text())
    assert set(saved["routers"]) == set(step.ROUTERS)
    for router, r in saved["routers"].items():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, router
        assert 0 < r["assignments_per_token"] <= 4, router  # about top-2 compute by construction


# -- experiments/gpu_check.sh ------------------------------------------------------------

GPU_CHECK = ROOT / "experiments" / "gpu_check.sh"


def run_gpu_check(out: Path, env_extra: dict, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True).returncode == 0


def test_gpu_check_runs_every_step_hands_the_matmul_rate_on_and_reports_failures(tmp_path):
    """Each step's command, as the script runs it, through a stand-in ``timeout`` that records
    its arguments: the kernel benchmark "succeeds" and writes a JSON, the other two fail."""
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
    assert proc.returncode == 1, proc.stdout + proc.stderr  # two steps failed
    commands = log.read_text().splitlines()
    assert commands == [
        "150 python -m pytest -q -m gpu tests/",
        f"200 python experiments/bench_kernels.py --out-dir {out} --dry-run --shapes decode --sets 1",
        f"100 python experiments/bench_model_step.py --out-dir {out} --dry-run --bench-json {out}/bench_kernels-test.json",
    ]
    for name in ("versions.txt", "nvidia-smi.txt", "pytest_gpu.txt", "bench_kernels.txt", "bench_model_step.txt"):
        assert (out / name).exists(), name
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
        "150 python -m pytest -q -m gpu tests/",
        f"200 python experiments/bench_kernels.py --out-dir {out}",
        f"100 python experiments/bench_model_step.py --out-dir {out}",
    ]


@pytest.mark.slow
def test_gpu_check_dry_run_end_to_end(tmp_path):
    """The real steps on the CPU (GPU tests skip; the benchmarks' --dry-run): under a minute when quiet."""
    out = tmp_path / "out"
    proc = run_gpu_check(out, {"DRY_RUN": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" in (out / "pytest_gpu.txt").read_text()
    (bench_json,) = out.glob("bench_kernels-*-cpu-dry-run.json")
    (step_json,) = out.glob("bench_model_step-*-cpu-dry-run.json")
    bench, step = json.loads(bench_json.read_text()), json.loads(step_json.read_text())
    assert bench["correctness"]["ok"] and set(bench["shapes"]) == {"decode"}
    assert step["matmul_TFLOPs"] == bench["floors"]["matmul_TFLOPs"]  # MFU uses the rate step 2 measured
