"""File bytes into GPU memory through two pinned host buffers: the read of one chunk overlaps the copy of the last.

Why (issue #34, cold start): a checkpoint read into a CUDA tensor went through a fresh pageable tensor per read —
page faults on every new buffer, then a synchronous pageable host-to-device copy that the driver stages once
more — and reached 0.39–0.42× the page-cache read rate on an H100. Here each read is cut into chunks of
``CHUNK_BYTES``: ``pread`` fills pinned slot i (page-locked once, reused for the whole load), an asynchronous
copy moves it to the destination on the current stream while ``pread`` fills slot i + 1, and an event per slot
says when its buffer may be filled again. Page-locked memory copies at the link's rate without the driver's
bounce buffer.

Consecutive reads keep the pipeline full: the slots rotate across reads (``DeviceStager`` remembers the next one)
and a read returns once its last copy is queued, not finished, so the ``pread`` of the next tensor overlaps the
copy of this one. Waiting for every copy at the end of each tensor cost a checkpoint of many tensors up to a
third of its read rate (pread, then copy, then pread … in series: 0.51–0.52× the page-cache rate on an H100;
kept full: 0.63×, with the threaded preads below 5.13 GB/s = 0.60× of a faster host's page cache — H100 hosts,
2026-12-07, docs/KERNELS.md "Issue #34").

Invariants: a slot's buffer is never refilled before the copy that reads it has finished (its event); a
destination's bytes are complete in the order of the stream that was current at its read (work queued there
after ``read`` sees them), and on the host once ``drain`` returns — ``SafetensorsIndex.close`` drains, so a
load's bytes are complete before its memory is mapped for peers or read by another stream; reads through one
stager are serialised (a lock), so concurrent fills never share a slot.

A chunk's ``pread`` is itself split over ``READ_THREADS`` threads (``ParallelFill``: pieces of at least
``MIN_PIECE_BYTES``, 4 KiB aligned): one thread copying from the page cache runs at one core's memcpy rate
(6–8 GB/s measured on the GPU hosts), and ``os.preadv`` releases the GIL, so the pieces of one chunk are read
side by side. The pieces of a chunk are all in its slot before its copy is queued.

``chunked_read(fill, nbytes, dst, slots, copy)`` is the loop itself over any slots (``HostSlot`` on CPU, with a
synchronous copy: the CPU tests check offsets, chunk edges and the rotation); ``DeviceStager`` gives the pinned
slots and the stream-ordered copy of one CUDA device.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

#: bytes per chunk: one ``pread`` and one copy launch per 16 MiB are negligible overheads, and two slots pin 32 MiB
CHUNK_BYTES = 16 * 2**20
#: slots: two is double buffering (read chunk i + 1 while chunk i is copied); more does not help a serial reader
SLOTS = 2
#: threads reading the pieces of one chunk: a page-cache read is one core's memcpy, so a second core reads faster,
#: but the pinned copies share the host's memory bandwidth with the reads: ``bench/staging_read.py`` on an H100 host
#: (2026-12-07) read at 0.82× the page-cache rate with 1 thread, 0.89× with 2, 0.73× with 4
READ_THREADS = min(2, os.cpu_count() or 1)
#: the smallest piece worth a thread (a hand-off costs tens of µs; 1 MiB takes ~150 µs to read); 4 KiB multiples
MIN_PIECE_BYTES = 1 << 20
PAGE_BYTES = 4096


@dataclass
class HostSlot:
    """A staging buffer whose copies are synchronous: always free."""

    buffer: Any

    def wait(self) -> None:
        return None

    def mark(self) -> None:
        return None


@dataclass
class PinnedSlot:
    """A pinned staging buffer and the event recorded after the copy that reads it."""

    buffer: Any
    stream: Any
    event: Any = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def mark(self) -> None:
        import torch

        self.event = torch.cuda.Event()
        self.event.record(self.stream)


def chunked_read(fill: Callable[[int, int, Any], None], nbytes: int, dst, slots, copy: Callable[[Any, Any], None],
                 chunk_bytes: int = CHUNK_BYTES, first_slot: int = 0, drain: bool = True) -> int:
    """Bytes ``[0, nbytes)`` of a source into the flat uint8 tensor ``dst``: ``fill(offset, n, buffer)`` writes the
    source's bytes ``[offset, offset + n)`` into ``buffer`` (a CPU uint8 tensor of n bytes); ``copy(dst_part,
    buffer)`` moves them on. Slots rotate from ``first_slot``; a slot is waited for before it is filled, and with
    ``drain`` all are at the end. Returns the slot the next read starts with."""
    done, index = 0, first_slot
    while done < nbytes:
        n = min(chunk_bytes, nbytes - done)
        slot = slots[index % len(slots)]
        slot.wait()
        buffer = slot.buffer[:n]
        fill(done, n, buffer)
        copy(dst[done:done + n], buffer)
        slot.mark()
        done += n
        index += 1
    if drain:
        drain_slots(slots)
    return index % len(slots)


def drain_slots(slots) -> None:
    """Wait for every slot's last copy."""
    for slot in slots:
        slot.wait()


def pieces(n: int, threads: int, min_piece: int = MIN_PIECE_BYTES) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``threads`` ``(offset, length)`` pieces of at least ``min_piece`` bytes, every
    boundary a multiple of ``PAGE_BYTES`` (whole pages per thread); one piece when ``n`` is small."""
    count = max(1, min(threads, n // max(min_piece, 1)))
    step = -(-n // count)
    step = -(-step // PAGE_BYTES) * PAGE_BYTES
    return [(start, min(step, n - start)) for start in range(0, n, step)]


@dataclass
class ParallelFill:
    """``fill(offset, n, buffer)`` run as ``pieces`` read side by side: the first piece on the calling thread, the
    others on ``pool``; returns when all are in ``buffer`` (the first error is raised, after every piece ended)."""

    fill: Callable[[int, int, Any], None]
    pool: ThreadPoolExecutor | None
    threads: int

    def __call__(self, offset: int, n: int, buffer) -> None:
        parts = pieces(n, self.threads) if self.pool is not None else [(0, n)]
        futures = [self.pool.submit(self.fill, offset + start, length, buffer[start:start + length])
                   for start, length in parts[1:]]
        try:
            start, length = parts[0]
            self.fill(offset + start, length, buffer[start:start + length])
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error


@dataclass
class DeviceStager:
    """Pinned slots for reads into one CUDA device (allocated at the first read, kept for the stager's life); the
    slots rotate across reads and a read returns with its copies queued (module docstring: ``drain``)."""

    device: Any
    chunk_bytes: int = CHUNK_BYTES
    read_threads: int = READ_THREADS
    _slots: list = field(default_factory=list)
    _next_slot: int = 0
    _pool: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: bytes read and seconds spent inside ``read`` and ``drain`` (the loader logs them beside its ``read_s``)
    bytes_staged: int = 0
    seconds: float = 0.0

    def read(self, fill: Callable[[int, int, Any], None], nbytes: int, dst) -> None:
        """``chunked_read`` into ``dst`` (a contiguous CUDA tensor of ``nbytes`` bytes) on the current stream: its
        bytes are there for work queued on that stream afterwards, and on the host after ``drain``."""
        import torch

        flat = dst.reshape(-1).view(torch.uint8)
        t0 = time.perf_counter()
        with self._lock:
            stream = torch.cuda.current_stream(self.device)  # the copies' stream: the caller's current one
            if not self._slots:
                self._slots = [PinnedSlot(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True), stream)
                               for _ in range(SLOTS)]
            for slot in self._slots:
                slot.stream = stream
            if self._pool is None and self.read_threads > 1:
                self._pool = ThreadPoolExecutor(self.read_threads - 1, thread_name_prefix="dwdp-pread")
            fill = ParallelFill(fill, self._pool, self.read_threads)
            self._next_slot = chunked_read(fill, nbytes, flat, self._slots,
                                           lambda part, buf: part.copy_(buf, non_blocking=True), self.chunk_bytes,
                                           first_slot=self._next_slot, drain=False)
            self.bytes_staged += nbytes
            self.seconds += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait until every queued copy has finished (the destinations are complete, the slots free)."""
        t0 = time.perf_counter()
        with self._lock:
            drain_slots(self._slots)
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Drain, and stop the reading threads (the pinned slots go with the stager)."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
