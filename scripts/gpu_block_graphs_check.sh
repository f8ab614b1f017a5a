#!/usr/bin/env bash
# Issue #34's MoE block incl. the router ÷ its two-GEMM floor, eager and replayed from CUDA graphs (the server's
# default), Qwen3 and DeepSeek-V3 shapes at 1K, 4K and 16K tokens, in one bounded run:
#   BUDGET_S=120 bash scripts/gpu_block_graphs_check.sh      # log: $OUT/gpu_block_graphs.log (+ JSON)
LOG_NAME=gpu_block_graphs.log
source "$(dirname "$0")/gpu_common.sh"

step "moe block, eager and graphed" 110 python3 bench/moe_block.py --cuda-graphs --rep-ms 50 \
  --json "$OUTDIR/moe_block_graphs.json"
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
