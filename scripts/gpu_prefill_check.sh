#!/usr/bin/env bash
# Issue #34's GPU measurements in one bounded run (< 8 min on one H200): the new gpu tests, then the benches.
# Run from the repository root on the GPU machine (torch 2.11, Triton 3.6, transformers 5.17; the worker's
# other wheels carried in .whl-lite, as /work/main/.gpu/setup.sh installs them):
#     bash scripts/gpu_prefill_check.sh            # log: $OUT/gpu_prefill_check.log (or ./gpu_prefill_check.log)
# Every step has its own time limit and the whole run a deadline (BUDGET_S): a step that would start past it is
# skipped and named in the log, so the call always returns its log. JSON rows land beside the log.
LOG_NAME=gpu_prefill_check.log
source "$(dirname "$0")/gpu_common.sh"

# 1. correctness: bitwise alone-vs-packed with --batch-invariant (3 archs + the GEMM at real shapes), fused router
step "gpu tests" 115 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rA \
  tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_router_gpu.py
# 2. --batch-invariant cost: per dense GEMM, then a 4-layer Qwen3-shape prefill at ISL 4K / 16K (writes the
#    2.4 GB bf16 checkpoint steps 4 and 5 reuse)
step "batch-invariant cost" 115 python3 bench/batch_invariant.py --iters 5 --isl 4096 16384 \
  --json "$OUTDIR/batch_invariant.json"
# 3. MoE block incl. router ÷ two-GEMM floor, today's router vs the fused one (Qwen3-30B, DeepSeek-V3 shapes)
step "moe block" 75 python3 bench/moe_block.py --tokens 1024 4096 16384 --rep-ms 60 --json "$OUTDIR/moe_block.json"
# 4. cold start to /readyz of that checkpoint, first vs second start with one compile cache (2 ranks, one GPU)
MODEL=$(timeout 120 python3 -c "from bench.prefill import ensure_model, parse_args
print(ensure_model(parse_args(['--isl', '16384', '--num-layers', '4', '--num-experts', '64'])))" | tail -1)
step "cold start" 110 python3 bench/cold_start.py --model "$MODEL" --backend cuda --dwdp-size 2 --timeout 50 \
  --json "$OUTDIR/cold_start.json"
# 5. eager host gap of the same prefill (CUDA-graphs default decision), model router vs fused router
step "host gap" 45 python3 bench/host_gap.py --isl 1024 4096 16384 --iters 3 --fused-router --json "$OUTDIR/host_gap.json"

echo "=== done in $(( $(date +%s) - START ))s; log $LOG" | tee -a "$LOG"
