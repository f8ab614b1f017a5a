#!/usr/bin/env bash
# Elastic group on one GPU (issue #30): the gpu test (4 ranks on cuda:0, kill -9 under 32 clients) and
# bench/elastic.py --backend cuda; run from the repository root on the GPU machine with .whl-lite carried.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-lite/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/worker:$PWD/operator
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 python3 -m pytest -p no:cacheprovider tests/gpu/test_elastic_gpu.py -x -q -s 2>&1 | grep -v "Writing model" | tail -25 | tee $OUT/elastic-gpu-test.log
timeout 200 python3 bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend cuda --clients 16 --window-s 8 2>&1 | tail -5 | tee $OUT/elastic-gpu-bench.log
