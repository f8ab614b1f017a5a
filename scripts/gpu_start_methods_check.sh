#!/usr/bin/env bash
# How the front starts its ranks, on one GPU (carry .whl-lite): DWDP_RANK_START=forkserver (the default: ranks forked
# from one process that imported torch and transformers once) against spawn (a fresh interpreter per rank), by
# bench/cold_start.py on the 2.2 GB bf16 Qwen3-shape checkpoint of bench/prefill.py, 2 and 4 ranks on the one GPU,
# the compile cache shared by all starts (each method's first start after the cache is warm: what a replacement pays)
#   BUDGET_S=240 bash scripts/gpu_start_methods_check.sh
# log: $OUT/gpu_start_methods.log (+ JSON beside it)
LOG_NAME=gpu_start_methods.log
source "$(dirname "$0")/gpu_common.sh"

MODEL=$(timeout 120 python3 -c "from bench.prefill import ensure_model, parse_args
print(ensure_model(parse_args(['--isl', '16384', '--num-layers', '4', '--num-experts', '64'])))" | tail -1)
CACHE=$(mktemp -d)
step "warm the compile cache" 90 env DWDP_RANK_START=forkserver python3 bench/cold_start.py --model "$MODEL" \
  --backend cuda --dwdp-size 2 --starts 1 --cache-dir "$CACHE" --timeout 80
for d in 2 4; do
  for how in spawn forkserver; do
    step "start d=$d $how" 70 env DWDP_RANK_START=$how python3 bench/cold_start.py --model "$MODEL" --backend cuda \
      --dwdp-size $d --starts 1 --cache-dir "$CACHE" --timeout 60 --json "$OUTDIR/start_${how}_d$d.json"
  done
done
echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
