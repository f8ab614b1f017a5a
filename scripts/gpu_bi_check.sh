#!/usr/bin/env bash
# Issue #34's --batch-invariant GEMM on one GPU, in one bounded run:
#   BUDGET_S=300 bash scripts/gpu_bi_check.sh
#     the GPU tests (rows bitwise alone vs packed, model logits alone vs packed for qwen3_moe / mixtral /
#     deepseek_v3), bench/bi_tiles.py (each candidate tiling ÷ cuBLAS on the Qwen3 and DeepSeek-V3 projections,
#     4K and 16K rows) and bench/batch_invariant.py (the mode's cost on the synthetic prefill, ISL 4K and 16K)
# log: $OUT/gpu_bi.log (+ JSON beside it)
LOG_NAME=gpu_bi.log
source "$(dirname "$0")/gpu_common.sh"

step "batch-invariant gpu tests" 120 python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
  tests/gpu/test_batch_invariant_gpu.py
step "bi tiles" 120 python3 bench/bi_tiles.py --iters 20 --json "$OUTDIR/bi_tiles.json"
step "batch-invariant cost" 115 python3 bench/batch_invariant.py --iters 5 --isl 4096 16384 \
  --json "$OUTDIR/batch_invariant.json"
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
