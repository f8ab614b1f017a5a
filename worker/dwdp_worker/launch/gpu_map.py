"""Which GPU each rank of a pod drives: local rank i → ``cuda:i`` of the pod's visible GPUs.

Invariants:
  1. Every rank process of a pod sees every GPU of the pod: nothing narrows ``CUDA_VISIBLE_DEVICES``
     per rank. The ranks of one pod import each other's expert allocations (``posix_fd`` handles on
     HGX, where a group is one pod holding all ``dwdpSize`` GPUs), and a CUDA handle can only be
     imported into a process that can see the device it lives on (TensorRT-LLM's launch scripts
     warn about the same trap). The rank picks its device with ``torch.cuda.set_device``.
  2. Local rank i uses device index i (the pod's ranks are ``DWDP_RANK_BASE + i``), so the mapping
     is the same on every pod and needs no coordination.
  3. Too few visible GPUs is an error naming the fix, never a silent oversubscription.
"""

from __future__ import annotations


def rank_devices(*, gpus_per_pod: int, visible_gpus: int, backend: str) -> list[str | None]:
    """Device of each local rank: ``cuda:i``, or ``None`` for every rank on the host backend
    (``backend == "host"``, or ``auto`` on a machine without GPUs)."""
    if backend == "host" or (backend == "auto" and visible_gpus == 0):
        return [None] * gpus_per_pod
    if visible_gpus < gpus_per_pod:
        raise ValueError(
            f"DWDP_GPUS_PER_POD={gpus_per_pod} ranks but {visible_gpus} GPU(s) are visible in this pod "
            f"(DWDP_BACKEND={backend}): request nvidia.com/gpu={gpus_per_pod} and do not narrow "
            f"CUDA_VISIBLE_DEVICES; every rank must see every GPU of the pod")
    return [f"cuda:{i}" for i in range(gpus_per_pod)]
