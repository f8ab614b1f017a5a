"""Transport: one shareable allocation per (layer, weight) holding this rank's experts, and
read-only views of the peers' allocations. Setup-time only.

Pipeline:
  1. ``add(key, …, fill)``: allocate ``layout.handle_bytes(b−a, eb, granularity)`` bytes, map them, let
     ``fill(view)`` write the local experts straight in (the loader reads safetensors slices into
     it: a rank never holds two copies of a big weight), unmap the staging view.
  2. ``exchange()``: export every allocation; fds go over a Unix socket (``fdpass``), fabric
     handles (bytes) through the rendezvous; import the peers this rank reads from and map each
     into a read-only reservation (access for the importing device only is enough over NVLink).
  3. ``release()``: idempotent; importers unmap + release before a barrier, owners after it.
Any failure during ``add``/``exchange`` releases everything created so far and re-raises.

Invariant: keys are added in the same order on every rank (the manager registers layers in
forward order), so allocation i of rank r is the same (layer, weight) everywhere.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from .fdpass import FdServer, fetch_fds
from .layout import handle_bytes
from .memory.base import Allocation, MemoryBackend
from .rendezvous import Rendezvous

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    key: Hashable
    expert_bytes: int
    shape: tuple[int, ...]  # per-expert shape
    dtype: object
    alloc: Allocation


def _close_fds(items) -> None:
    for item in items:
        if isinstance(item, int):
            os.close(item)


class Transport:
    def __init__(self, *, memory: MemoryBackend, rendezvous: Rendezvous, rank: int,
                 ranges: Sequence[tuple[int, int]], token_key: bytes):
        self.memory, self.rendezvous, self.rank = memory, rendezvous, rank
        self.ranges = tuple(ranges)
        self._token_key = token_key
        self._entries: list[_Entry] = []
        self._index: dict[Hashable, int] = {}
        self._peer_allocs: list[Allocation] = []
        self._peer_views: dict[tuple[int, Hashable], tuple[int, int]] = {}  # -> (va, nbytes)
        self._exchanged = False
        self._released = False

    @property
    def num_local(self) -> int:
        a, b = self.ranges[self.rank]
        return b - a

    def add(self, key: Hashable, *, expert_shape: tuple[int, ...], dtype, expert_bytes: int,
            fill: Callable[[object], None]) -> None:
        if self._exchanged:
            raise RuntimeError("cannot add weights after the handle exchange")
        if key in self._index:
            raise ValueError(f"weight {key!r} added twice")
        nbytes = handle_bytes(self.num_local, expert_bytes, self.memory.granularity)
        alloc = self.memory.create(nbytes)
        va = None
        try:
            va = self.memory.reserve(nbytes)
            self.memory.map(va, alloc)
            self.memory.set_access(va, nbytes, writable=True)
            view = self.memory.as_tensor(va, (self.num_local, *expert_shape), dtype)
            fill(view)
            del view
        except BaseException:
            if va is not None:
                self.memory.unmap(va, nbytes)
                self.memory.free_reservation(va, nbytes)
            self.memory.release(alloc)
            raise
        self.memory.unmap(va, nbytes)
        self.memory.free_reservation(va, nbytes)
        self._index[key] = len(self._entries)
        self._entries.append(_Entry(key, expert_bytes, tuple(expert_shape), dtype, alloc))

    def local_allocation(self, key: Hashable) -> Allocation:
        return self._entries[self._index[key]].alloc

    def peer_view(self, peer: int, key: Hashable) -> int:
        """Base address of ``peer``'s allocation for ``key`` in this process (read-only)."""
        return self._peer_views[(peer, key)][0]

    def exchange(self, peers: Sequence[int], *, progress: Callable[[int], None] | None = None) -> None:
        """Import the allocations of ``peers`` (the ranks this rank copies from)."""
        if self._exchanged:
            raise RuntimeError("handles were already exchanged")
        self._exchanged = True
        try:
            if self.memory.handle_transport == "fd":
                self._exchange_fds(sorted(set(peers)), progress)
            else:
                self._exchange_bytes(sorted(set(peers)), progress)
            self.rendezvous.barrier("transport/imported")
        except BaseException:
            self.release(barrier=False)
            raise

    def _peer_sizes(self, peer: int) -> list[int]:
        a, b = self.ranges[peer]
        return [handle_bytes(b - a, e.expert_bytes, self.memory.granularity) for e in self._entries]

    def _import_all(self, peer: int, shareables: list, progress) -> None:
        sizes = self._peer_sizes(peer)
        if len(shareables) != len(sizes):
            _close_fds(shareables)
            raise RuntimeError(f"rank {peer} exported {len(shareables)} weights, this rank registered "
                               f"{len(sizes)}: ranks loaded different models?")
        for i, (entry, shareable, nbytes) in enumerate(zip(self._entries, shareables, sizes)):
            try:
                alloc = self.memory.import_(shareable, nbytes)  # consumes an fd
            except BaseException:
                _close_fds(shareables[i + 1:])
                raise
            self._peer_allocs.append(alloc)
            va = self.memory.reserve(nbytes)
            self.memory.map(va, alloc)
            self._peer_views[(peer, entry.key)] = (va, nbytes)
            self.memory.set_access(va, nbytes, writable=False)
            if progress:
                progress(1)

    def _exchange_fds(self, peers: list[int], progress) -> None:
        exported = [self.memory.export(e.alloc) for e in self._entries]
        server = None
        try:
            server = FdServer(exported, token_key=self._token_key)
            names = self.rendezvous.allgather("transport/fd-servers", server.name.encode())
            for peer in peers:
                self._import_all(peer, fetch_fds(names[peer].decode(), token_key=self._token_key), progress)
            self.rendezvous.barrier("transport/fds-fetched")
        finally:
            if server is not None:
                server.close()
            for fd in exported:
                os.close(fd)

    def _exchange_bytes(self, peers: list[int], progress) -> None:
        blobs = [self.memory.export(e.alloc) for e in self._entries]
        width = len(blobs[0]) if blobs else 0
        gathered = self.rendezvous.allgather("transport/handles", b"".join(blobs))
        for peer in peers:
            raw = gathered[peer]
            self._import_all(peer, [raw[i * width:(i + 1) * width] for i in range(len(self._entries))], progress)

    def release(self, *, barrier: bool = True) -> None:
        """Idempotent. Peer views first, then (optionally) a barrier, then this rank's allocations."""
        if self._released:
            return
        self._released = True
        errors = []
        for (va, nbytes) in self._peer_views.values():
            try:
                self.memory.unmap(va, nbytes)
                self.memory.free_reservation(va, nbytes)
            except Exception as exc:  # noqa: BLE001 - keep releasing, report the first
                errors.append(exc)
        for alloc in self._peer_allocs:
            self.memory.release(alloc)
        self._peer_views.clear()
        self._peer_allocs.clear()
        if barrier:
            try:
                self.rendezvous.barrier("transport/released")
            except Exception as exc:  # noqa: BLE001 - a dead peer must not block our teardown
                log.warning("release barrier failed (%s); releasing local allocations anyway", exc)
        for entry in self._entries:
            self.memory.release(entry.alloc)
        if errors:
            log.warning("errors while unmapping peer views: %s", errors[0])
