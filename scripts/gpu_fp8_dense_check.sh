#!/usr/bin/env bash
# What the 2026-12-06 evening session built without a GPU (issue #34), in one bounded run: the GPU tests it wrote
# (FP8 dense linears, pinned checkpoint reads, CUDA graphs on by default), the cold start with the pinned reads
# (read rate × page cache), then the #34 prefill shape (Qwen3, 8 layers, 128 experts, 16 heads, d = 4, ISL 16K,
# CUDA graphs) in bf16, in FP8 with the dense linears kept FP8 (DWDP_FP8_DENSE=on) and dequantized at load — the
# end-to-end ratio is bf16 ms ÷ FP8 ms. Steps past the budget are skipped and named: run the rest in a second call.
#     bash scripts/gpu_fp8_dense_check.sh          # log: $OUT/gpu_fp8_dense_check.log; carry .whl-lite .cutlass
LOG_NAME=gpu_fp8_dense_check.log
source "$(dirname "$0")/gpu_common.sh"

step "gpu tests" 150 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_fp8_linear_gpu.py \
  tests/gpu/test_device_staging_gpu.py tests/gpu/test_serving_gpu.py
MODEL=$(timeout 120 python3 -c "from bench.prefill import ensure_model, parse_args
print(ensure_model(parse_args(['--isl', '16384', '--num-layers', '4', '--num-experts', '64'])))" | tail -1)
step "cold start" 110 python3 bench/cold_start.py --model "$MODEL" --backend cuda --dwdp-size 2 --timeout 50 \
  --json "$OUTDIR/cold_start.json"
SHAPE=(--isl 16384 --num-layers 8 --num-experts 128 --dwdp-size 4 --iters 5 --cuda-graphs 4)
step "prefill bf16" 100 python3 bench/prefill.py "${SHAPE[@]}" --num-heads 16
step "prefill fp8, dense kept fp8" 150 python3 bench/prefill.py "${SHAPE[@]}" --quant fp8 --fp8-dense
step "prefill fp8, dense dequantized" 150 python3 bench/prefill.py "${SHAPE[@]}" --quant fp8
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
