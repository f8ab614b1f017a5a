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
third of its read rate (pread, then copy, then pread … in series: 0.51–0.52× the page-cache rate on an H100).

Invariants: a slot's buffer is never refilled before the copy that reads it has finished (its event); a
destination's bytes are complete in the order of the stream that was current at its read (work queued there
after ``read`` sees them), and on the host once ``drain`` returns — ``SafetensorsIndex.close`` drains, so a
load's bytes are complete before its memory is mapped for peers or read by another stream; reads through one
stager are serialised (a lock), so concurrent fills never share a slot.

``chunked_read(fill, nbytes, dst, slots, copy)`` is the loop itself over any slots (``HostSlot`` on CPU, with a
synchronous copy: the CPU tests check offsets, chunk edges and the rotation); ``DeviceStager`` gives the pinned
slots and the stream-ordered copy of one CUDA device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

#: bytes per chunk: one ``pread`` and one copy launch per 16 MiB are negligible overheads, and two slots pin 32 MiB
CHUNK_BYTES = 16 * 2**20
#: slots: two is double buffering (read chunk i + 1 while chunk i is copied); more does not help a serial reader
SLOTS = 2


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


@dataclass
class DeviceStager:
    """Pinned slots for reads into one CUDA device (allocated at the first read, kept for the stager's life); the
    slots rotate across reads and a read returns with its copies queued (module docstring: ``drain``)."""

    device: Any
    chunk_bytes: int = CHUNK_BYTES
    _slots: list = field(default_factory=list)
    _next_slot: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, fill: Callable[[int, int, Any], None], nbytes: int, dst) -> None:
        """``chunked_read`` into ``dst`` (a contiguous CUDA tensor of ``nbytes`` bytes) on the current stream: its
        bytes are there for work queued on that stream afterwards, and on the host after ``drain``."""
        import torch

        flat = dst.reshape(-1).view(torch.uint8)
        with self._lock:
            stream = torch.cuda.current_stream(self.device)  # the copies' stream: the caller's current one
            if not self._slots:
                self._slots = [PinnedSlot(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True), stream)
                               for _ in range(SLOTS)]
            for slot in self._slots:
                slot.stream = stream
            self._next_slot = chunked_read(fill, nbytes, flat, self._slots,
                                           lambda part, buf: part.copy_(buf, non_blocking=True), self.chunk_bytes,
                                           first_slot=self._next_slot, drain=False)

    def drain(self) -> None:
        """Wait until every queued copy has finished (the destinations are complete, the slots free)."""
        with self._lock:
            drain_slots(self._slots)
