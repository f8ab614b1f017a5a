"""One rank's KV region: a single byte buffer, allocated and registered with NIXL once, cut into blocks.

GPU memory on a CUDA rank (the decode side READs it GPU-to-GPU; UCX picks NVLink/IB/cuda-IPC), host
memory on a CPU rank. Registration pins/maps memory and costs far more than a request (NIXL/UCX
registration is a kernel call and, for IB, a memory-key exchange), so it happens once at start, never
per request; the budget *is* the region, so it can never be exceeded.

Invariants: a sequence's stream occupies ``blocks_for(stream_bytes)`` blocks; ``write`` fills them in
``block_ids`` order (one copy straight into the region when the blocks form one run, otherwise through
a staging buffer on the same device); ``close`` deregisters (idempotent) before the buffer is dropped.
"""

from __future__ import annotations

from typing import Sequence

from .blocks import BlockAllocator, runs
from .layout import write_stream
from .params import KvRegionDesc, KvTensorDesc, MemKind

#: default block size: a real model's sequence (Qwen3-235B: ~190 KB/token; DeepSeek-V3 as transformers
#: caches it: ~4.9 MB/token) spans few descriptors, and a short prompt wastes under one block
DEFAULT_BLOCK_BYTES = 1 << 20


class KvRegion:
    def __init__(self, capacity_bytes: int, *, block_bytes: int = DEFAULT_BLOCK_BYTES, device="cpu"):
        import torch

        if block_bytes <= 0 or block_bytes % 64:
            raise ValueError(f"KV block size must be a positive multiple of 64 bytes (got {block_bytes})")
        num_blocks = capacity_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV budget {capacity_bytes} B is smaller than one block ({block_bytes} B)")
        self.device = torch.device(device)
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(num_blocks)
        self.buffer = torch.empty(num_blocks * block_bytes, dtype=torch.uint8, device=self.device)
        self.mem = MemKind.VRAM if self.device.type == "cuda" else MemKind.DRAM

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
