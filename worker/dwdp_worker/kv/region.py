"""One rank's KV region: a single byte buffer, allocated and registered with NIXL once, cut into blocks.

GPU memory on a CUDA rank (the decode side READs it GPU-to-GPU; UCX picks cuda_ipc on a node, RDMA
across nodes), host memory on a CPU rank. Registration pins/maps memory and costs far more than a request
(NIXL/UCX registration is a kernel call and, for IB, a memory-key exchange), so it happens once at start,
never per request; the budget *is* the region, so it can never be exceeded.

How a CUDA region is allocated (``RegionMemory``; ``DWDP_KV_REGION_MEMORY``, docs/KV_TRANSFER.md "GPU
transports"): UCX's ``cuda_ipc`` transport exports a buffer to another process of the node either with a
legacy IPC handle (``cuIpcGetMemHandle``: memory from ``cudaMalloc``/``cuMemAlloc``) or with a fabric
handle (VMM memory created with ``CU_MEM_HANDLE_TYPE_FABRIC``); VMM memory with only a POSIX-fd handle
type — what PyTorch's caching allocator hands out under ``expandable_segments:True`` — is "no IPC" for the
UCX that nixl-cu13 1.5.1 bundles (its ``libuct_cuda`` has no POSIX-fd arm), and a READ of it falls back to
software emulation over TCP. So the default, ``cuda_malloc``, is a dedicated ``cuMemAlloc`` allocation:
legacy-IPC capable whatever ``PYTORCH_CUDA_ALLOC_CONF`` says, and its own base address, so the decode side
maps exactly the region. ``torch`` (the caching allocator, as before) stays for comparison (bench).

Invariants: a sequence's stream occupies ``blocks_for(stream_bytes)`` blocks; ``write`` fills them in
``block_ids`` order (one copy straight into the region when the blocks form one run, otherwise through
a staging buffer on the same device); ``close`` (idempotent, after the NIXL deregistration) frees a
``cuda_malloc`` allocation; the tensor over it owns nothing and must not be used after.
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Sequence

from .blocks import BlockAllocator, runs
from .layout import write_stream
from .params import KvRegionDesc, KvTensorDesc, MemKind

#: default block size: a real model's sequence (Qwen3-235B: ~190 KB/token; DeepSeek-V3 as transformers
#: caches it: ~4.9 MB/token) spans few descriptors, and a short prompt wastes under one block
DEFAULT_BLOCK_BYTES = 1 << 20


class RegionMemory(StrEnum):
    """How a CUDA rank allocates its KV region (host memory on a CPU rank either way)."""

    CUDA_MALLOC = "cuda_malloc"   # a dedicated cuMemAlloc: legacy CUDA IPC, so UCX's cuda_ipc can serve READs
    TORCH = "torch"               # PyTorch's caching allocator (VMM, no cuda_ipc, under expandable_segments)


DEFAULT_REGION_MEMORY = RegionMemory.CUDA_MALLOC


def region_memory_from_env(environ=os.environ) -> RegionMemory:
    from dwdp_runtime.contract import TuningEnv

    raw = environ.get(TuningEnv.KV_REGION_MEMORY, "") or DEFAULT_REGION_MEMORY.value
    try:
        return RegionMemory(raw)
    except ValueError:
        raise ValueError(f"{TuningEnv.KV_REGION_MEMORY}={raw!r}: one of {', '.join(m.value for m in RegionMemory)}"
                         ) from None


def _cuda_malloc(nbytes: int, device):
    """A uint8 tensor over a fresh ``cuMemAlloc`` of ``nbytes`` on ``device`` (in torch's primary context) and
    the pointer to free."""
    import torch

    from dwdp_runtime.memory.cuda import _CudaArray, check, load_driver

    torch.cuda.set_device(device)
    torch.empty(1, device=device)                  # torch creates (and makes current) the primary context first
    driver = load_driver()
    check(driver, driver.cuInit(0), "cuInit")
    ptr = int(check(driver, driver.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))
    t = torch.as_tensor(_CudaArray(ptr, (nbytes,), "|u1"), device=device)
    if t.data_ptr() != ptr:
        check(driver, driver.cuMemFree(ptr), "cuMemFree")
        raise RuntimeError(f"the KV region tensor over 0x{ptr:x} is not zero-copy")
    return t, ptr


class KvRegion:
    def __init__(self, capacity_bytes: int, *, block_bytes: int = DEFAULT_BLOCK_BYTES, device="cpu",
                 memory: RegionMemory | str | None = None):
        import torch

        if block_bytes <= 0 or block_bytes % 64:
            raise ValueError(f"KV block size must be a positive multiple of 64 bytes (got {block_bytes})")
        num_blocks = capacity_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV budget {capacity_bytes} B is smaller than one block ({block_bytes} B)")
        self.device = torch.device(device)
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(num_blocks)
        self.mem = MemKind.VRAM if self.device.type == "cuda" else MemKind.DRAM
        self.memory = RegionMemory(memory) if memory is not None else region_memory_from_env()
        self._cuda_ptr: int | None = None
        if self.mem is MemKind.VRAM and self.memory is RegionMemory.CUDA_MALLOC:
            self.buffer, self._cuda_ptr = _cuda_malloc(num_blocks * block_bytes, self.device)
        else:
            self.buffer = torch.empty(num_blocks * block_bytes, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        """Free a ``cuda_malloc`` region (after NIXL deregistered it); idempotent, a no-op otherwise."""
        if self._cuda_ptr is not None:
            import torch

            from dwdp_runtime.memory.cuda import check, load_driver

            torch.cuda.synchronize(self.device)   # no copy into the region may still run
            driver = load_driver()
            ptr, self._cuda_ptr, self.buffer = self._cuda_ptr, None, None
            check(driver, driver.cuMemFree(ptr), "cuMemFree")

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, stream_bytes: int) -> int:
        return max(1, -(-stream_bytes // self.block_bytes))

    def describe(self) -> KvRegionDesc:
        return KvRegionDesc(mem=self.mem, base_addr=self.buffer.data_ptr(), device_id=self.device.index or 0,
                            block_bytes=self.block_bytes, num_blocks=self.num_blocks)

    def _run_view(self, first: int, count: int):
        return self.buffer[first * self.block_bytes:(first + count) * self.block_bytes]

    def write(self, block_ids: list[int], descs: Sequence[KvTensorDesc], kv, stream_bytes: int) -> None:
        import torch

        spans = runs(block_ids)
        if len(spans) == 1:
            write_stream(self._run_view(*spans[0]), descs, kv)
            return
        staging = torch.empty(len(block_ids) * self.block_bytes, dtype=torch.uint8, device=self.device)
        write_stream(staging, descs, kv)
        pos = 0
        for first, count in spans:
            n = count * self.block_bytes
            self._run_view(first, count).copy_(staging[pos:pos + n])
            pos += n

    def gather(self, block_ids: list[int]):
        """The stream of ``block_ids`` as one flat tensor (a copy; tests and local reads)."""
        import torch

        return torch.cat([self._run_view(f, c) for f, c in runs(block_ids)])
