#!/usr/bin/env bash
# Set up and run the embedded default: a local DWDP group on CPU serving a tiny synthetic model.
# It writes the model, starts the group (ranks as processes, TCPStore on loopback), sends a request,
# prints the answer and /healthz, and checks it against the unsharded transformers model.
#   scripts/demo.sh                      # defaults (1 group of 2 ranks, host memory backend)
#   scripts/demo.sh --dwdp-size 3        # extra flags go to `dwdp-worker demo`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c 'import torch' 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e '.[worker]'
exec dwdp-worker demo "$@"
