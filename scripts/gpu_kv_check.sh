#!/usr/bin/env bash
# The KV handoff on one GPU (issue #36), everything in one run, < 8 minutes on one H200:
#   1. the machine: GPU, NVLink state (UCX turns cuda_ipc GET off when NVML shows no active link), versions;
#   2. tests/gpu/test_kv_gpu.py: pulled K/V bitwise, the continuation bitwise the local-cache decode and within
#      bf16 tolerance of generate's model by teacher forcing (a wrong cache must fail the same check);
#   3. bench/kv_handoff.py: our pull, a raw NIXL READ of the same bytes and a device copy, side by side, for
#      the region allocations and UCX settings of docs/KV_TRANSFER.md ("GPU transports"), with the UCX
#      protocol that carried each READ.
# Assumes NIXL is importable (nixl-cu13 installed from carried wheels by the caller). Run from anywhere:
#     bash scripts/gpu_kv_check.sh
# Output goes to stdout and to ${OUT:-/tmp}/gpu_kv_check.log; UCX logs of the bench to ${OUT:-/tmp}/ucx_logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp}"
LOG="$OUT_DIR/gpu_kv_check.log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/worker:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
: >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }
run() {  # run LIMIT_S CMD...: bounded, output kept, exit code shown
  local limit=$1; shift
  say "+ $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "= exit $rc"
  return 0
}

say "== gpu_kv_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
run 30 nvidia-smi -L
run 30 nvidia-smi nvlink -s
run 30 nvidia-smi topo -m
run 60 python - <<'EOF'
import ctypes, glob, importlib.metadata as md, os
for pkg in ("torch", "transformers", "nixl-cu13", "cuda-bindings"):
    try:
        print(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"{pkg} not installed")
import torch
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
try:
    import nixl_cu13
    libs = glob.glob(os.path.join(os.path.dirname(nixl_cu13.__file__), "..", "nixl_cu13.libs", "libucp-*.so*"))
    ucp = ctypes.CDLL(libs[0])
    a, b, c = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
    print(f"UCX {a.value}.{b.value}.{c.value} ({os.path.basename(libs[0])})")
except Exception as exc:  # noqa: BLE001
    print("UCX version unknown:", exc)
print("UCX_* / PYTORCH_CUDA_ALLOC_CONF set by the caller:",
      {k: v for k, v in os.environ.items() if k.startswith("UCX_") or k == "PYTORCH_CUDA_ALLOC_CONF"} or "none")
EOF

say "== 1/2 GPU test (the continuation asserted; pull GB/s printed)"
run 300 python -m pytest -p no:cacheprovider -m gpu tests/gpu/test_kv_gpu.py -s -q

say "== 2/2 bench: ours vs raw NIXL READ vs device copy, per region allocation and UCX setting"
run 240 python bench/kv_handoff.py --device cuda:0 --sizes-mib 32,256 --iters 5 --hidden-size 1024 --isl 2048

tar czf "$OUT_DIR/ucx_logs.tgz" -C /tmp $(cd /tmp && ls -d kv-bench-* 2>/dev/null) 2>/dev/null && say "UCX logs: $OUT_DIR/ucx_logs.tgz"
say "== done $(date -u +%H:%M:%SZ); log: $LOG"
