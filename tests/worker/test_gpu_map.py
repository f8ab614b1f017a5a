"""Local rank → GPU: rank i drives cuda:i and every rank sees all of the pod's GPUs (HGX one-pod groups)."""

import pytest

from dwdp_worker.launch.gpu_map import rank_devices


def test_hgx_pod_maps_local_rank_to_device_index():
    assert rank_devices(gpus_per_pod=8, visible_gpus=8, backend="auto") == [f"cuda:{i}" for i in range(8)]
    assert rank_devices(gpus_per_pod=4, visible_gpus=8, backend="cuda") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_host_backend_and_gpuless_auto_use_no_device():
    assert rank_devices(gpus_per_pod=2, visible_gpus=8, backend="host") == [None, None]
    assert rank_devices(gpus_per_pod=2, visible_gpus=0, backend="auto") == [None, None]


@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_too_few_visible_gpus_is_an_error_naming_the_fix(backend):
    with pytest.raises(ValueError, match="nvidia.com/gpu=4.*CUDA_VISIBLE_DEVICES"):
        rank_devices(gpus_per_pod=4, visible_gpus=1 if backend == "auto" else 0, backend=backend)
