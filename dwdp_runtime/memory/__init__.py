"""Memory backends and the ``auto`` choice.

``select_backend("auto", device)``:
  * a CUDA device with an IMEX channel (``/dev/nvidia-caps-imex-channels/channel*``) where a
    fabric allocation succeeds → ``cuda`` with ``fabric`` handles (GB200/NVL72, across nodes);
  * else a CUDA device → ``cuda`` with ``posix_fd`` handles (one node: HGX H100/H200/B200);
  * else → ``host`` (memfd + mmap; CI and the CPU demo).
The choice is logged once. An unavailable explicit choice raises ``BackendUnavailable`` at start,
never mid-forward. CUDA modules are imported only when a CUDA backend is chosen.
"""

from __future__ import annotations

import glob
import logging

from ..contract import Backend
from .base import HANDLE_TYPES, Allocation, BackendUnavailable, MemoryBackend
from .host import HostMemory

log = logging.getLogger(__name__)

# DWDP_BACKEND's values (contract.Backend) and, to force one handle type, the handle types themselves
BACKENDS: tuple[str, ...] = (*(b.value for b in Backend), *HANDLE_TYPES)
IMEX_CHANNEL_GLOB = "/dev/nvidia-caps-imex-channels/channel*"

__all__ = ["Allocation", "BackendUnavailable", "MemoryBackend", "HostMemory", "select_backend", "BACKENDS"]


def imex_channel_present() -> bool:
    return bool(glob.glob(IMEX_CHANNEL_GLOB))


def _cuda_backend(device, handle_type: str, granularity: int | None):
    try:
        from .cuda import CudaMemory
    except ImportError as exc:
        raise BackendUnavailable(f"the cuda backend needs cuda-python (pip install cuda-python): {exc}") from exc
    return CudaMemory(device=device, handle_type=handle_type, granularity=granularity)


def select_backend(name: str = Backend.AUTO.value, *, device=None, granularity: int | None = None) -> MemoryBackend:
    """Build the memory backend ``name`` for ``device`` (a torch.device, index or None)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown memory backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == Backend.HOST:
        return HostMemory(granularity=granularity)
    import torch

    want_cuda = name == Backend.CUDA or name in HANDLE_TYPES or (
        device is not None and torch.device(device).type == "cuda")
    if name == Backend.AUTO and device is None and torch.cuda.is_available():
        device, want_cuda = torch.device("cuda", torch.cuda.current_device()), True
    if not want_cuda:
        log.info("DWDP memory backend: host (no CUDA device requested)")
        return HostMemory(granularity=granularity)
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"memory backend {name!r} needs a CUDA GPU and none is visible "
                                 f"(use --backend host to run on CPU)")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if name in HANDLE_TYPES:
        return _cuda_backend(device, name, granularity)
    if imex_channel_present():
        try:
            backend = _cuda_backend(device, "fabric", granularity)
            backend.probe()
            log.info("DWDP memory backend: cuda/fabric (IMEX channel present)")
            return backend
        except Exception as exc:  # noqa: BLE001 - fall back with a reason
            log.info("fabric handles unavailable (%s); using posix_fd", exc)
    log.info("DWDP memory backend: cuda/posix_fd on %s", device)
    return _cuda_backend(device, "posix_fd", granularity)
