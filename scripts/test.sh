#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian/Python 3.11 machine, then run it.
# This is the README's test command and what CI (.ci/run) calls. GPU tests (-m gpu) are excluded:
# they run on a GPU machine (docs/GPU.md).
#   scripts/test.sh                 # all CPU tests, including the real-API-server (k8s) suite
#   scripts/test.sh tests/runtime   # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== python deps"
# torch: the CPU build of 2.13.0 (on disk on CI machines); never upgrade an installed torch
$PY -c 'import torch' 2>/dev/null || $PY -m pip install -q torch==2.13.0
# sm-gather = nvidia-cutlass-dsl: tests/kernels/test_fp8_cute_compile.py compiles the CuTe DSL kernels for
# sm_90a without a GPU (and runs ptxas on them)
$PY -m pip install -q -e '.[worker,operator,test,mpi,kv,sm-gather]' mpich

if [ -x scripts/k8s-install.sh ]; then
  echo "== kubernetes control plane binaries (built once, cached in ~/.cache/k8s-test)"
  bash scripts/k8s-install.sh
fi

echo "== tests"
# two workers (pytest-xdist), a module at a time, the k8s suite on one of them (tests/conftest.py); the 25 slowest
# tests are listed at the end. DWDP_TEST_WORKERS=0 runs everything in this process.
exec $PY -m pytest -m "not gpu" -p no:cacheprovider -n "${DWDP_TEST_WORKERS:-2}" --dist loadgroup --durations=25 -p no:benchmark "$@"
