#!/usr/bin/env bash
# Issue #34's cold start on one GPU, in one bounded run (carry .whl-lite):
#   BUDGET_S=150 bash scripts/gpu_cold_start_check.sh
#     the pinned-staging GPU tests (reads into GPU memory equal the CPU read, queued reads complete after drain),
#     bench/staging_read.py (the reads alone into GPU memory, 1/2/4 pread threads, × the page-cache rate), then
#     bench/cold_start.py on the 2.2 GB bf16 Qwen3-shape checkpoint of bench/prefill.py (2 ranks, one GPU):
#     first vs second start, the read rate × the page-cache rate of the same files, the compile share
# log: $OUT/gpu_cold_start.log (+ JSON beside it)
LOG_NAME=gpu_cold_start.log
source "$(dirname "$0")/gpu_common.sh"

step "staging gpu tests" 60 python3 -m pytest -m gpu -p no:cacheprovider -q -rA tests/gpu/test_device_staging_gpu.py
MODEL=$(timeout 120 python3 -c "from bench.prefill import ensure_model, parse_args
print(ensure_model(parse_args(['--isl', '16384', '--num-layers', '4', '--num-experts', '64'])))" | tail -1)
step "staging read" 60 python3 bench/staging_read.py --model "$MODEL" --threads 1 2 4 \
  --json "$OUTDIR/staging_read.json"
step "cold start" 110 python3 bench/cold_start.py --model "$MODEL" --backend cuda --dwdp-size 2 --timeout 50 \
  --json "$OUTDIR/cold_start.json"
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
