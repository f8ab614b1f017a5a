#!/usr/bin/env bash
# Issue #34's MoE-block tile A/B on one GPU, in one bounded run (carry .whl-lite):
#   BUDGET_S=300 bash scripts/gpu_tiles_check.sh [tiles|defaults]
#     bench/moe_block.py --tiles: the fused block (router included) under each candidate tiling, eager and graphed,
#     ÷ the two-GEMM floor, at the loads where tuning.default_config hands one tiling over to the next (Qwen3 at
#     4K = 256 rows per expert, 8K, 16K; the DeepSeek-V3 shape over 64 experts at 2K = 256 rows, 4K)
# log: $OUT/gpu_tiles.log (+ JSON beside it)
LOG_NAME=gpu_tiles.log
source "$(dirname "$0")/gpu_common.sh"

#     defaults: the fused block on the default table (graphed and eager) at 4K and 16K, both shapes
if [ "${1:-tiles}" = defaults ]; then
step "block on the defaults" 120 python3 bench/moe_block.py --shapes qwen3 dsv3 --tokens 4096 16384 --cuda-graphs \
  --rep-ms 50 --json "$OUTDIR/moe_block_defaults.json"
else
step "tiles qwen3" 150 python3 bench/moe_block.py --tiles --shapes qwen3 --tokens 4096 8192 16384 --rep-ms 50 \
  --json "$OUTDIR/tiles_qwen3.json"
step "tiles dsv3" 120 python3 bench/moe_block.py --tiles --shapes dsv3 --tokens 2048 4096 --rep-ms 50 \
  --json "$OUTDIR/tiles_dsv3.json"
fi
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
