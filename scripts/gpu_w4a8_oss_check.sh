#!/usr/bin/env bash
# Issue #31's W4A8 for gpt-oss and DeepSeek-V4 (biases, interleaved rows, clamped gates, 2880-wide rows) on one GPU,
# in one bounded run (carry .whl-lite; no CuTe DSL needed: these experts run on the Triton FP8 kernels):
#   BUDGET_S=300 bash scripts/gpu_w4a8_oss_check.sh [all|tests]
#     the GPU tests (ragged re-encoding bytes, W4A8 near bf16 at gpt-oss's shape, chunks, batch invariance; both
#     clamped-gate models served through each FP4 kernel vs their dequantized twins), then bench/clamped_fp4.py
#     (W4A8 and weight-only ÷ bf16 kernels and ÷ the dequantizing forward, gpt-oss's shape), bench/fp4_moe.py at the
#     DeepSeek-V3 expert shape on the Triton FP8 kernels (where DeepSeek-V4's clamped experts run W4A8)
# log: $OUT/gpu_w4a8_oss.log (+ JSON beside it)
LOG_NAME=gpu_w4a8_oss.log
source "$(dirname "$0")/gpu_common.sh"

step "w4a8 gpt-oss gpu test" 120 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_w4a8_gpu.py \
  -k gpt_oss
if [ "${1:-all}" = all ]; then
step "clamped fp4 bench" 100 python3 bench/clamped_fp4.py --tokens 1024 4096 16384 --experts 32 \
  --json "$OUTDIR/clamped_fp4.json"
step "w4a8 triton bench, deepseek-v3 shape (deepseek-v4's path)" 120 env DWDP_FP8_BACKEND=triton \
  python3 bench/fp4_moe.py --shapes deepseek_v3 --formats mxfp4 --tokens 4096 16384 --json "$OUTDIR/fp4_moe_triton.json"
fi
step "clamped-gate gpu test" 150 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_fp4_gpu.py \
  -k "clamped${CLAMPED_KERNEL:+ and $CLAMPED_KERNEL}"
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
