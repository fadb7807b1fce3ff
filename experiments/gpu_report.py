"""The GPU check's verdicts in one dated page: read what ``experiments/gpu_check.sh`` wrote to a
folder and say which goals are met, what ``backend="auto"`` should run on CUDA, and every figure
the issues ask for (issues 45 and 46).

    PYTHONPATH=.:kernels python experiments/gpu_report.py OUT_DIR      # gpu_check.sh's last step

Reads ``OUT_DIR``'s newest ``bench_kernels-*.json``, ``bench_model_step-*.json``,
``bench_kernels-*-profile-A.txt``, ``pytest_gpu.xml`` and ``train/metrics.jsonl`` (each optional:
a step that failed or timed out is reported as missing) and writes
``OUT_DIR/gpu_report-<date>-<gpu>.{md,json}``.

Goals (shape A: T 16,384, D 2,048, F 1,408, E 64, k 6; the Triton kernels): dispatch + combine at
least 70% of the HBM bound, layer forward + backward within 1.35x of the GEMM floor measured in
the same run, at least 2x torch eager. The auto rule: ``moe.experts.CUDA_AUTO`` moves from
grouped_mm to triton only if the Triton kernels pass their correctness and bitwise checks and are
faster than grouped_mm forward + backward at every shape timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

VEOMNI_H100_FWD_TFLOPS = 242.0
"""VeOmni issue 460: torch._grouped_mm's forward at shape V (S 32,768, H 2,048, F 768, E 128, k 8)
on an H100 in bf16, about 24% of its 989 TFLOP/s peak."""


def newest(folder: Path, pattern: str) -> Path | None:
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def pytest_counts(xml: Path | None) -> dict | None:
    """tests, failures, errors, skipped from a junit XML (None if pytest wrote none)."""
    if xml is None or not xml.exists():
        return None
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return counts


def train_summary(jsonl: Path | None) -> dict | None:
    """First and last training loss, the last step's tokens/s and peak memory, and the final
    evaluation's teacher-forced and causal (decoded) losses."""
    if jsonl is None or not jsonl.exists():
        return None
    steps = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if not steps:
        return {"steps": 0}
    last = steps[-1]
    out = {"steps": len(steps), "first_loss": steps[0]["loss"], "last_loss": last["loss"]}
    out |= {k: last.get(k) for k in ("tokens_per_s", "peak_memory_mib")}
    out |= {k: last[k] for k in ("eval/teacher_forced_loss", "eval/causal_loss", "eval/leakage_gap") if k in last}
    return out


def report(folder: Path) -> dict:
    kernels_json, step_json = newest(folder, "bench_kernels-*.json"), newest(folder, "bench_model_step-*.json")
    kernels = json.loads(kernels_json.read_text()) if kernels_json else None
    steps = json.loads(step_json.read_text()) if step_json else None
    profile = newest(folder, "bench_kernels-*-profile-A.txt")
    out: dict = {
        "date": dt.date.today().isoformat(),
        "gpu": (kernels or steps or {}).get("gpu", "unknown"),
        "pytest_gpu": pytest_counts(folder / "pytest_gpu.xml"),
        "train": train_summary(folder / "train" / "metrics.jsonl"),
        "files": {"bench_kernels": str(kernels_json), "bench_model_step": str(step_json), "profile_A": str(profile)},
    }
    if kernels:
        v = kernels["shapes"].get("V", {})
        out["kernels"] = {
            "correctness": kernels["correctness"],
            "floors": kernels["floors"],
            "goals": kernels.get("goals"),
            "auto_rule": kernels.get("auto_rule"),
            "shapes": {
                n: {k: r.get(k) for k in ("ms", "TFLOPs", "fraction_of_bf16_peak", "fraction_of_matmul_rate")}
                | {k: r.get(k) for k in r if k.endswith(("_over_gemm_floor", "_fwd_bwd", "speedup_vs_torch_eager"))}
                | {"dispatch_combine_fraction_of_bandwidth": r.get("dispatch_combine_fraction_of_bandwidth")}
                for n, r in kernels["shapes"].items()
            },
            "veomni_V_grouped_mm_fwd_TFLOPs": v.get("TFLOPs", {}).get("grouped_mm_fwd"),
            "veomni_H100_reported_fwd_TFLOPs": VEOMNI_H100_FWD_TFLOPS,
        }
    if steps:
        out["model_step"] = steps["runs"]
    return out


def markdown(r: dict) -> str:
    lines = [f"# GPU check {r['date']} on {r['gpu']}", ""]
    t = r["pytest_gpu"]
    lines.append(
        "GPU tests: missing (the step did not write pytest_gpu.xml)"
        if t is None
        else f"GPU tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
        + (f" (failed: {', '.join(t['failed'])})" if t["failed"] else "")
    )
    k = r.get("kernels")
    if k is None:
        lines += ["", "Kernel benchmark: missing."]
    else:
        c = k["correctness"]
        lines += ["", f"Correctness ({c['dtype']}, tolerance {c['tolerance_rel']} relative to the fp32 reference):"]
        for path, e in c["paths"].items():
            worst = max(e["rel_error"].values()) if "rel_error" in e else None
            lines.append(
                f"- {path}: "
                + (e["error"] if worst is None else f"worst {worst:.2e}, ok {e['ok']}")
                + (f", bitwise rerun {e['bitwise_reproducible']}" if "bitwise_reproducible" in e else "")
            )
        if "triton_vs_grouped_mm_rel" in c:
            lines.append(f"- triton vs grouped_mm: worst {max(c['triton_vs_grouped_mm_rel'].values()):.2e}")
        fl = k["floors"]
        lines += [
            "",
            f"Floors measured in this run: HBM {fl['hbm_bandwidth_GBps']:.0f} GB/s, bf16 matmul "
            f"{fl['matmul_TFLOPs']:.0f} TFLOP/s (nominal peak {fl.get('bf16_peak_TFLOPs')}).",
            "",
        ]
        if k.get("goals"):
            lines += ["| goal at shape A (Triton) | value | goal | met |", "|---|---:|---:|---|"]
            for key, g in k["goals"].items():
                lines.append(f"| {key} | {g['value']:.3f} | {g['goal']} | {'yes' if g['met'] else 'NO'} |")
        lines += ["", "| shape | path | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd / peak |"]
        lines.append("|---|---|---:|---:|---:|---:|")
        for name, s in k["shapes"].items():
            for path in ("triton", "grouped_mm", "torch_eager"):
                ms, rate = s["ms"].get(f"{path}_fwd_bwd"), s["TFLOPs"] or {}
                peak = (s["fraction_of_bf16_peak"] or {}).get(f"{path}_fwd_bwd")
                lines.append(
                    f"| {name} | {path} | {_f(ms)} | {_f(rate.get(f'{path}_fwd'))} | "
                    f"{_f(rate.get(f'{path}_fwd_bwd'))} | {_f(peak)} |"
                )
        a = k.get("auto_rule") or {}
        lines += [
            "",
            f"Shape V, grouped_mm forward: {_f(k['veomni_V_grouped_mm_fwd_TFLOPs'])} TFLOP/s "
            f"(VeOmni reports {k['veomni_H100_reported_fwd_TFLOPs']:.0f} on an H100).",
            "",
            f"Auto rule: Triton over grouped_mm, fwd+bwd time by shape {a.get('triton_over_grouped_mm_fwd_bwd')}; "
            + (
                "the Triton kernels are equal and faster everywhere: CUDA_AUTO may move to triton."
                if a.get("triton_equal_and_faster")
                else "CUDA_AUTO stays grouped_mm."
            ),
        ]
    if r.get("model_step"):
        lines += ["", "| gpu100m step | ms | tokens/s | MFU (measured rate) | MFU (peak) | first loss |"]
        lines.append("|---|---:|---:|---:|---:|---:|")
        for key, s in r["model_step"].items():
            if "error" in s:
                lines.append(f"| {key} | error: {s['error'][:100]} | | | | |")
                continue
            lines.append(
                f"| {key} | {s['step_ms']:.1f} | {s['tokens_per_s']:,.0f} | {_f(s.get('mfu'))} | "
                f"{_f(s.get('mfu_peak'))} | {s['first_loss']:.4f} |"
            )
    tr = r.get("train")
    lines += [
        "",
        "Training run (train.py: meta-device build, compile and activation checkpointing as gpu_check.sh asked, causal evaluation): ",
    ]
    lines[-1] += "missing." if tr is None else json.dumps(tr)
    return "\n".join(lines) + "\n"


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the folder gpu_check.sh wrote ($OUT)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        p.error(f"{folder} is not a folder")
    r = report(folder)
    stem = f"gpu_report-{r['date']}-{re.sub(r'[^A-Za-z0-9]+', '-', r['gpu']).strip('-').lower()}"
    (folder / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    (folder / f"{stem}.md").write_text(markdown(r))
    sys.stdout.write(markdown(r))
    return r


if __name__ == "__main__":
    main()
