#!/usr/bin/env bash
# Issue #31's clamped gates (gpt-oss, DeepSeek-V4) fused into the weight-only FP4 kernels, in one bounded run:
#   BUDGET_S=120 bash scripts/gpu_clamped_check.sh
#     the GPU test (gpt-oss MXFP4 and DeepSeek-V4 FP4 models through the kernels vs their dequantized twins on
#     transformers' forward), then bench/clamped_fp4.py (gpt-oss's expert shape: fused ÷ the dequantizing forward)
# log: $OUT/gpu_clamped.log (+ JSON beside it)
LOG_NAME=gpu_clamped.log
source "$(dirname "$0")/gpu_common.sh"

step "clamped-gate gpu test" 90 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_fp4_gpu.py \
  -k clamped
step "clamped fp4 bench" 60 python3 bench/clamped_fp4.py --tokens 1024 4096 --experts 32 \
  --json "$OUTDIR/clamped_fp4.json"
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
