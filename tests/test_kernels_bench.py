"""The benchmark scripts' CPU dry runs: they must run end to end before a GPU is lent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_bench_kernels_dry_run(tmp_path):
    bench = load_script("bench_kernels")
    results = bench.main(["--dry-run", "--shapes", "A,decode", "--sets", "2", "--out-dir", str(tmp_path)])
    files = list(tmp_path.glob("bench_kernels-*-cpu-dry-run.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["gpu"] == "cpu-dry-run"
    assert saved["correctness"]["ok"] and saved["correctness"]["paths"]["triton"]["bitwise_reproducible"]
    for key in ("dispatch_combine_fraction_of_bandwidth", "layer_fwd_bwd_over_gemm_floor", "speedup_vs_torch_eager"):
        assert set(saved[key]) == {"A", "decode"}
        assert all(v > 0 for v in saved[key].values()), key
    assert saved["shapes"]["A"]["ms"]["triton_fwd_bwd"] > 0
    assert results["path"] == str(files[0])


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


def test_gpu_check_script_names_every_step():
    script = (ROOT / "experiments" / "gpu_check.sh").read_text()
    for needle in ("-m gpu", "bench_kernels.py", "bench_model_step.py", "--bench-json", "OUT="):
        assert needle in script, needle
