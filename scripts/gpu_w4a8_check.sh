#!/usr/bin/env bash
# Issue #31's W4A8 path on one GPU, in one bounded run (carry .whl-lite .cutlass: the CuTe DSL kernels):
#   bash scripts/gpu_w4a8_check.sh kernels   # GPU tests (re-encoding bytes, W4A8 vs dequantized, FP4 models
#                                            # W4A8 and weight-only, d = 2 group) + bench/fp4_moe.py (both shapes,
#                                            # MXFP4 and NVFP4, 4K and 16K tokens: weight-only, W4A8 ÷ bf16)
#   bash scripts/gpu_w4a8_check.sh model     # a trained model quantized to NVFP4 and MXFP4, served by a d = 4
#                                            # group with W4A8: top-1 agreement with the dequantized bf16 model
#                                            # (weight-only is that model's numbers by construction), and sharded ÷
#                                            # unsharded prefill at 8K
#   BUDGET_S=540 bash scripts/gpu_w4a8_check.sh all   # the W4A8 GPU tests, the bench and the NVFP4 agreement
#                                            # (ISL 4K) in one call, for a short device budget
# log: $OUT/gpu_w4a8_<stage>.log (+ JSON beside it)
STAGE=${1:-kernels}
LOG_NAME=gpu_w4a8_$STAGE.log
source "$(dirname "$0")/gpu_common.sh"

case $STAGE in
kernels)
  step "w4a8 gpu tests" 240 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_w4a8_gpu.py \
    tests/gpu/test_fp4_gpu.py tests/gpu/test_fp8_linear_gpu.py
  step "fp4 bench" 210 python3 bench/fp4_moe.py --rep-ms 25 --json "$OUTDIR/fp4_moe.json"
  ;;
model)
  TRAINED=(--isl 8192 --dwdp-size 4 --num-layers 4 --num-experts 32 --train-steps 300 --prompts 500 --iters 3
           --work-dir /tmp/w4a8-bench)
  step "nvfp4 w4a8" 200 python3 bench/fp8_prefill.py "${TRAINED[@]}" --quant nvfp4 --fp4-kernel w4a8 \
    --json "$OUTDIR/nvfp4_w4a8.json"
  step "mxfp4 w4a8" 150 python3 bench/fp8_prefill.py "${TRAINED[@]}" --quant mxfp4 --fp4-kernel w4a8 \
    --json "$OUTDIR/mxfp4_w4a8.json"
  ;;
quick)  # the W4A8 GPU tests and the bench only
  step "w4a8 gpu tests" 110 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_w4a8_gpu.py
  step "fp4 bench" 80 python3 bench/fp4_moe.py --rep-ms 20 --json "$OUTDIR/fp4_moe.json"
  ;;
all)  # one bounded call for a short device budget: the W4A8 tests, the bench, the NVFP4 agreement at 4K
  step "w4a8 gpu tests" 150 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_w4a8_gpu.py \
    tests/gpu/test_fp8_linear_gpu.py
  step "fp4 bench" 170 python3 bench/fp4_moe.py --rep-ms 20 --json "$OUTDIR/fp4_moe.json"
  step "nvfp4 w4a8" 200 python3 bench/fp8_prefill.py --isl 4096 --dwdp-size 4 --num-layers 4 --num-experts 32 \
    --train-steps 300 --prompts 300 --iters 3 --work-dir /tmp/w4a8-bench --quant nvfp4 --fp4-kernel w4a8 \
    --json "$OUTDIR/nvfp4_w4a8.json"
  ;;
*) echo "unknown stage $STAGE: kernels | model | all | quick" | tee -a "$LOG"; exit 2 ;;
esac
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
