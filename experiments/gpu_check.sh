#!/usr/bin/env bash
# One-shot GPU check (issue 7): GPU tests, the kernel benchmark, one training step per router.
#
#   bash experiments/gpu_check.sh                  # writes under ./gpu_out
#   OUT=/some/dir bash experiments/gpu_check.sh    # writes under $OUT
#   DRY_RUN=1 OUT=/tmp/gc bash experiments/gpu_check.sh   # CPU: the same steps, the scripts' --dry-run
#                                                         # (tiny shapes; GPU tests skip); under a minute
#
# Steps (each under its own timeout; total under 8 minutes on an H200):
#   1. versions and nvidia-smi                     -> $OUT/versions.txt, $OUT/nvidia-smi.txt
#   2. pytest -m gpu tests/                        -> $OUT/pytest_gpu.txt            (<= 150 s)
#   3. experiments/bench_kernels.py (full)         -> $OUT/bench_kernels-*.json/.txt (<= 200 s)
#   4. experiments/bench_model_step.py, 5 routers  -> $OUT/bench_model_step-*.json   (<= 100 s)
#      gpu100m preset, bf16 autocast, MFU against the matmul rate step 3 measured.
# Later steps run even if an earlier one fails; the exit status is non-zero if any failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export WANDB_MODE=disabled
unset TRITON_INTERPRET
status=0
start=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ "${DRY_RUN:-0}" = 1 ]; then
    dry=(--dry-run); bench_args=(--dry-run --shapes decode --sets 1)
else
    dry=(); bench_args=()
fi
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
           torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
    2>&1 | tee "$OUT/versions.txt"

echo "== [1/3] GPU tests"
timeout 150 python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" || status=1

echo "== [2/3] kernel benchmark"
timeout 200 python experiments/bench_kernels.py --out-dir "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench_kernels.txt" || status=1
bench_json=$(ls -t "$OUT"/bench_kernels-*.json 2>/dev/null | head -n 1)

echo "== [3/3] one training step per router (gpu100m, bf16 autocast)"
if [ -n "$bench_json" ]; then mfu_args=(--bench-json "$bench_json"); else mfu_args=(); fi
timeout 100 python experiments/bench_model_step.py --out-dir "$OUT" "${dry[@]}" "${mfu_args[@]}" 2>&1 \
    | tee "$OUT/bench_model_step.txt" || status=1

echo "== done in $(( $(date +%s) - start )) s, status $status; results in $OUT"
exit $status
