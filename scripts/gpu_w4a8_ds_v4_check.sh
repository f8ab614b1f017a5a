#!/usr/bin/env bash
# Issue #31: DeepSeek-V4's clamped silu in the CuTe fused gate_up's epilogue (W4A8), on one H100/H200, in one bounded
# run (carry .whl-lite and .cutlass: the CuTe DSL kernels):
#   BUDGET_S=300 bash scripts/gpu_w4a8_ds_v4_check.sh [all|tests]
#     the GPU tests (the clamped fused gate_up vs the block math; W4A8 at DeepSeek-V4's expert shape on the CuTe
#     kernels near the bf16 kernels with the same clamp, chunks, batch invariance), then bench/fp4_moe.py at that
#     shape (H 4096, I 2048, top-6, 64 experts, clamp 10): W4A8 on CuTe (DWDP_FP8_BACKEND=cute: the clamp on CuTe
#     is opt-in until this has run), then on the Triton FP8 kernels (auto's path), each ÷ bf16 in the same run
# log: $OUT/gpu_w4a8_ds_v4.log (+ JSON beside it)
LOG_NAME=gpu_w4a8_ds_v4.log
source "$(dirname "$0")/gpu_common.sh"

step "clamped cute gpu tests" 150 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA \
  tests/gpu/test_fp8_cute_gpu.py tests/gpu/test_w4a8_gpu.py -k "fused_gate_up or deepseek_v4"
if [ "${1:-all}" = all ]; then
step "w4a8 cute bench, deepseek-v4 shape" 150 env DWDP_FP8_BACKEND=cute python3 bench/fp4_moe.py --shapes deepseek_v4 --formats mxfp4 \
  --tokens 4096 16384 --json "$OUTDIR/fp4_moe_ds_v4_cute.json"
step "w4a8 triton bench, deepseek-v4 shape" 120 env DWDP_FP8_BACKEND=triton python3 bench/fp4_moe.py \
  --shapes deepseek_v4 --formats mxfp4 --tokens 4096 16384 --json "$OUTDIR/fp4_moe_ds_v4_triton.json"
fi
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
