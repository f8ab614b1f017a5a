#!/usr/bin/env bash
# CUDA graphs by default (issue #34) on one GPU in one bounded run: the graph tests (padded buckets replay their
# eager forward bitwise; the served default), the eager host gap against a graph replay, and the #34 prefill
# shape (Qwen3, 8 layers, 128 experts, 16 heads, d = 4) eager vs graphs at ISL 4K and 16K (MFU).
#     bash scripts/gpu_graphs_check.sh             # log: $OUT/gpu_graphs_check.log; carry .whl-lite
LOG_NAME=gpu_graphs_check.log
source "$(dirname "$0")/gpu_common.sh"

step "gpu tests" 150 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/gpu/test_prefill_graphs_gpu.py \
  tests/gpu/test_serving_gpu.py
step "host gap" 100 python3 bench/host_gap.py --isl 1024 3000 4096 16384 --iters 5 --graphs --json "$OUTDIR/host_gap.json"
SHAPE=(--num-layers 8 --num-experts 128 --num-heads 16 --dwdp-size 4 --iters 5)
for isl in 16384 4096; do
  for graphs in 0 4; do
    step "prefill ISL $isl graphs $graphs" 100 python3 bench/prefill.py --isl "$isl" "${SHAPE[@]}" --cuda-graphs "$graphs"
  done
done
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
