#!/usr/bin/env bash
# FP8 dense linears (DWDP_FP8_DENSE=on, issue #34) on one GPU in one bounded run: the kernel tests, then the #34
# prefill shape (Qwen3, 8 layers, 128 experts, 16 heads, d = 4, ISL 16K, CUDA graphs) in bf16, in FP8 with the
# dense linears dequantized at load, and in FP8 with them kept FP8 — the end-to-end ratio is bf16 ms ÷ FP8 ms.
#     bash scripts/gpu_fp8_dense_check.sh          # log: $OUT/gpu_fp8_dense_check.log; carry .whl-lite .cutlass
LOG_NAME=gpu_fp8_dense_check.log
source "$(dirname "$0")/gpu_common.sh"

step "fp8 dense tests" 120 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_fp8_linear_gpu.py
SHAPE=(--isl 16384 --num-layers 8 --num-experts 128 --dwdp-size 4 --iters 5 --cuda-graphs 4)
step "prefill bf16" 100 python3 bench/prefill.py "${SHAPE[@]}" --num-heads 16
step "prefill fp8, dense kept fp8" 150 python3 bench/prefill.py "${SHAPE[@]}" --quant fp8 --fp8-dense
step "prefill fp8, dense dequantized" 150 python3 bench/prefill.py "${SHAPE[@]}" --quant fp8
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
