#!/usr/bin/env bash
# One-shot GPU check (issues 7, 45, 46, 56): everything a lent H200 should answer, in one command.
#
#   bash experiments/gpu_check.sh                  # writes under ./gpu_out
#   OUT=/some/dir bash experiments/gpu_check.sh    # writes under $OUT
#   DRY_RUN=1 OUT=/tmp/gc bash experiments/gpu_check.sh   # CPU: the same steps, tiny (the scripts'
#                                                         # --dry-run; GPU tests skip); 5-10 min loaded
#
# Steps (each under its own timeout; the timeouts add up to 570 s, the runs to about 6 min on an H200):
#   1. pytest -m gpu tests/ (also as junit XML)   -> pytest_gpu.txt, pytest_gpu.xml           (<= 120 s)
#   2. experiments/bench_kernels.py, shapes A, V (VeOmni's), B, decode: the Triton kernels and the
#      grouped_mm backend checked against the reference (same losses, bitwise reruns), the HBM and
#      matmul floors, dispatch + combine vs HBM, fwd+bwd vs the GEMM floor, vs torch eager,
#      TFLOP/s and fraction of bf16 peak, a profile of both backends at A
#                                                 -> bench_kernels-<date>-<gpu>.json, -profile-A.txt (<= 150 s)
#   3. experiments/bench_model_step.py: gpu100m, every router x {grouped_mm, triton} eager,
#      topk and capacity compiled; tokens/s, MFU against step 2's matmul rate, first losses
#                                                 -> bench_model_step-<date>-<gpu>.json           (<= 150 s)
#   4. experiments/train.py, gpu100m (tiny in the dry run): the meta-device build, --compile,
#      activation checkpointing, backend auto, evaluation with the causal loss decoded through
#      the KV cache                               -> train/metrics.jsonl, train.txt               (<= 105 s)
#   5. experiments/bench_router_gemm.py --device cuda: router_dtype="bf16_fp32" through torch.mm's
#      out_dtype branch (CPU cannot run it) against the fp64 GEMM of the same bf16 values: share of
#      top-2 sets equal to fp64's beside the cast and bf16 logits, and each one's time
#                                                 -> bench_router_gemm-<date>-cuda.md/.json      (<= 30 s)
#   6. experiments/gpu_report.py: goals met or not, the auto rule -> gpu_report-<date>-<gpu>.md/.json (<= 15 s)
# Versions and nvidia-smi first. Later steps run even if an earlier one fails; the exit status is
# non-zero if any failed. Results are dated files under $OUT: commit them to experiments/results/.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd):$(pwd)/kernels${PYTHONPATH:+:$PYTHONPATH}"   # moe/ and the kernels (kernels/causal_moe_kernels) without an install
export WANDB_MODE=disabled
unset TRITON_INTERPRET
status=0
start=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ "${DRY_RUN:-0}" = 1 ]; then
    kernel_args=(--dry-run --shapes A,V,decode --sets 1)
    gemm_args=(--device cpu --batches 1 --rounds 1)
    step_args=(--dry-run --routers topk,expert_choice --compile-routers topk)
    train_args=(--preset tiny --device cpu --steps 4 --batch-size 2 --seq-len 32 --activation-checkpointing selective
                --eval-windows 2 --eval-batch-size 2 --causal-stride 8 --log-every 2)
else
    kernel_args=(); step_args=(); gemm_args=(--device cuda)
    train_args=(--preset gpu100m --steps 30 --batch-size 8 --seq-len 1024 --compile --activation-checkpointing full
                --eval-windows 8 --eval-batch-size 8 --causal-stride 128 --log-every 10)
fi
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
           torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
    2>&1 | tee "$OUT/versions.txt"

echo "== [1/6] GPU tests"
timeout 120 python -m pytest -q -m gpu tests/ --junitxml "$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.txt" || status=1

echo "== [2/6] kernel benchmark: triton, grouped_mm, torch eager"
timeout 150 python experiments/bench_kernels.py --out-dir "$OUT" "${kernel_args[@]}" 2>&1 | tee "$OUT/bench_kernels.txt" || status=1
bench_json=$(ls -t "$OUT"/bench_kernels-*.json 2>/dev/null | head -n 1)

echo "== [3/6] one training step per router and backend, eager and compiled (bf16 autocast)"
if [ -n "$bench_json" ]; then mfu_args=(--bench-json "$bench_json"); else mfu_args=(); fi
timeout 150 python experiments/bench_model_step.py --out-dir "$OUT" "${step_args[@]}" "${mfu_args[@]}" 2>&1 \
    | tee "$OUT/bench_model_step.txt" || status=1

echo "== [4/6] training run: meta build, compile, activation checkpointing, causal evaluation"
timeout 105 python experiments/train.py "${train_args[@]}" --backend auto --eval-every 0 \
    --metrics-jsonl "$OUT/train/metrics.jsonl" 2>&1 | tee "$OUT/train.txt" || status=1

echo "== [5/6] router GEMM: bf16 in, fp32 out (torch.mm out_dtype) against fp64"
timeout 30 python experiments/bench_router_gemm.py --out "$OUT" "${gemm_args[@]}" 2>&1 | tee "$OUT/bench_router_gemm.txt" || status=1

echo "== [6/6] report"
timeout 15 python experiments/gpu_report.py "$OUT" 2>&1 | tee "$OUT/gpu_report.txt" || status=1

echo "== done in $(( $(date +%s) - start )) s, status $status; results in $OUT"
exit $status
