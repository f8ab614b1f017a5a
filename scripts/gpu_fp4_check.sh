#!/usr/bin/env bash
# FP4 experts on one H200, in under 8 minutes (issue #31): the GPU tests, then the weight-only bench.
#   scripts/gpu_fp4_check.sh [OUT_DIR]       (default: ./out/fp4; run from anywhere)
# Needs torch with CUDA, Triton and cuda-python (docs/GPU.md "Running": on the lent machines set PYTHONPATH as
# there; CuTe DSL is not needed — the FP4 path is Triton only). Writes OUT_DIR/pytest.log, OUT_DIR/bench.json,
# OUT_DIR/bench.log. Budget: tests ~3 min (compiles + a d = 2 group), bench ~3 min (2 shapes x 2 formats x 2 T).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-out/fp4}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/worker:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

echo "== GPU tests (tests/gpu/test_fp4_gpu.py)"
rc=0
timeout 270 $PY -m pytest -m gpu -p no:cacheprovider -q -s tests/gpu/test_fp4_gpu.py 2>&1 | tee "$OUT/pytest.log" \
  || rc=$?

echo "== bench/fp4_moe.py (weight-only FP4 vs bf16 _grouped_mm, ISL 4K/16K, Qwen3-30B and DeepSeek-V3 shapes)"
timeout 210 $PY bench/fp4_moe.py --tokens 4096 16384 --rep-ms 25 --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" || rc=$?
echo "== done (rc=$rc): $OUT/pytest.log, $OUT/bench.log, $OUT/bench.json"
exit $rc
