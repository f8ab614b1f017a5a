"""Fixed-size block allocator over one registered KV region (pure: no torch, no NIXL).

The region is ``num_blocks`` blocks of ``block_bytes``; a sequence's KV stream takes
``ceil(stream_bytes / block_bytes)`` of them. Blocks are the unit the decode side names in
``remote_block_ids`` (as vLLM's NixlConnector does): the region is registered once and never
re-registered, so allocation is only bookkeeping.

Invariants:
  * ``allocate(n)`` returns ``n`` distinct free block ids or ``None`` (never a partial allocation):
    the byte budget is the region, so it can never be exceeded.
  * It prefers one contiguous run (first fit): a contiguous run is one NIXL descriptor and one
    device copy instead of one per block. When the free space is fragmented it takes the lowest
    free ids (still correct: the decode side reads run by run).
  * ``free(ids)`` of an id that is not allocated raises (a double free is a bug, never ignored).
  * ``quarantine(ids, until)`` takes allocated blocks out of use without making them free: no
    ``allocate`` hands them out before ``thaw(now)`` with ``now >= until`` frees them. The KV store
    quarantines blocks a READ may still be reading (a lapsed lease, an abort), so a READ in flight
    reads its own request's bytes, never a new owner's. A quarantined block is neither free nor
    allocated (freeing it raises); ``num_free`` never counts it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


_FREE, _ALLOCATED, _QUARANTINED = 1, 0, 2   # a block's state byte (``find`` looks for runs of _FREE)


class DoubleFreeError(RuntimeError):
    """A block was freed that was not allocated."""


def runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """``(first_block, count)`` of each maximal run of consecutive ids, in the order given."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


@dataclass
class BlockAllocator:
    num_blocks: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"a KV region needs at least one block (got {self.num_blocks})")
        self._free = bytearray(b"\x01") * self.num_blocks  # 1 = free, 0 = allocated, 2 = quarantined
        self._num_free = self.num_blocks
        self._quarantine: deque[tuple[float, list[int]]] = deque()   # (free again at, blocks), FIFO
        self._num_quarantined = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_quarantined(self) -> int:
        return self._num_quarantined

    def allocate(self, n: int) -> list[int] | None:
        if n < 1:
            raise ValueError(f"allocate needs n >= 1 (got {n})")
        if n > self._num_free:
            return None
        start = self._free.find(b"\x01" * n)
        ids = list(range(start, start + n)) if start >= 0 else self._lowest_free(n)
        for b in ids:
            self._free[b] = 0
        self._num_free -= n
        return ids

    def _lowest_free(self, n: int) -> list[int]:
        ids, pos = [], 0
        while len(ids) < n:
            pos = self._free.index(1, pos)
            ids.append(pos)
            pos += 1
        return ids

    def _check_allocated(self, block_ids: list[int]) -> None:
        if len(set(block_ids)) != len(block_ids):
            raise DoubleFreeError(f"blocks freed twice in one call: {sorted(block_ids)}")
        for b in block_ids:
            if not 0 <= b < self.num_blocks or self._free[b] != _ALLOCATED:
                raise DoubleFreeError(f"block {b} is not allocated")

    def free(self, block_ids: list[int]) -> None:
        self._check_allocated(block_ids)
        for b in block_ids:
            self._free[b] = _FREE
        self._num_free += len(block_ids)

    def quarantine(self, block_ids: list[int], until: float) -> None:
        """Allocated → out of use until ``thaw(now >= until)`` (never handed out before)."""
        self._check_allocated(block_ids)
        for b in block_ids:
            self._free[b] = _QUARANTINED
        self._num_quarantined += len(block_ids)
        self._quarantine.append((until, list(block_ids)))

    def thaw(self, now: float) -> int:
        """Free every quarantined block whose time has come; how many were freed."""
        freed = 0
        kept: deque[tuple[float, list[int]]] = deque()
        while self._quarantine:
            until, ids = self._quarantine.popleft()
            if now < until:
                kept.append((until, ids))
                continue
            for b in ids:
                self._free[b] = _FREE
            freed += len(ids)
        self._quarantine = kept
        self._num_quarantined -= freed
        self._num_free += freed
        return freed
