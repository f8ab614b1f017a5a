#!/usr/bin/env bash
# Shared set-up of the scripts/gpu_*_check.sh runs (sourced, never run): the worker's wheels from .whl-lite (and
# CuTe DSL from .cutlass/cutlass.tar.xz when carried), PYTHONPATH, a cold Triton cache, the log $LOG under $OUT,
# and ``step NAME LIMIT_S CMD...``: each step has its own time limit, the whole run a deadline (BUDGET_S), and a
# step that would start past it is skipped and named in the log, so the call always returns its log.
# The sourcing script sets LOG_NAME first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-$PWD}
LOG=$OUTDIR/${LOG_NAME:?set LOG_NAME before sourcing gpu_common.sh}
BUDGET_S=${BUDGET_S:-465}
START=$(date +%s)
: > "$LOG"

if [ -d .whl-lite ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-lite/*.whl 2>&1 | tail -2
fi
CUTLASS_PATH=
if [ -f .cutlass/cutlass.tar.xz ]; then  # docs/GPU.md: CuTe DSL for the FP8 kernels, unpacked in seconds
  python3 -c "import tarfile; tarfile.open('.cutlass/cutlass.tar.xz').extractall('/tmp/cutlass')"
  CUTLASS_PATH=/tmp/cutlass:/tmp/cutlass/nvidia_cutlass_dsl/dsl_packages:
fi
export PYTHONPATH=$CUTLASS_PATH/tmp/site:$PWD:$PWD/worker:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/gpu-check-triton   # cold for this run; cold_start.py uses its own fresh cache
unset TRITON_INTERPRET

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local now=$(( $(date +%s) - START ))
  if (( now + 20 > BUDGET_S )); then
    echo "=== SKIPPED $name (at ${now}s of the ${BUDGET_S}s budget)" | tee -a "$LOG"; return
  fi
  (( limit > BUDGET_S - now )) && limit=$(( BUDGET_S - now ))
  echo "=== $name (limit ${limit}s, t=${now}s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee -a "$LOG"

