#!/usr/bin/env bash
# Elastic group on one GPU (issue #30): the gpu tests (4 ranks on cuda:0; kill -9 of rank 1 and SIGSTOP of rank 0,
# the store's host, under 32 clients, each followed by the replacement's rejoin) and bench/elastic.py --backend cuda
# (both signals); run from the repository root on the GPU machine with .whl-lite carried (docs/GPU.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-lite/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/worker:$PWD/operator
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp}
timeout 300 python3 -m pytest -p no:cacheprovider tests/gpu/test_elastic_gpu.py -x -q -s 2>&1 \
  | grep -v "Writing model\|^frame\|^\[W\|^\[E\|Exception raised\|omitting" | tail -25 | tee $OUT/elastic-gpu-test.log
for sig in "--signal kill --victim 1" "--signal stop --victim 0"; do
  timeout 120 python3 bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend cuda --clients 16 --window-s 5 $sig \
    2>&1 | tail -2 | tee -a $OUT/elastic-gpu-bench.log
done
