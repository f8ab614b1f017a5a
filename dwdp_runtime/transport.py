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

Replicas (``layout.HolderLayout``, r > 1): per key a rank owns one allocation per stored run —
handle 0 its primary range (the one its composite maps), handle j its replica run j−1, filled by
``fill_replica(view, start, end)`` from the same reader. All of a peer's handles are imported at
setup (mappings only, no copy: a survivor must be able to read a spare without a new exchange), and
the rank maps its own replica runs read-only too (it may be an expert's surviving source for
itself). ``drop_peer(peer)`` unmaps and releases every view of a lost peer: after it, no address of
that peer's memory exists in this process (what a device loss requires; docs/RUNTIME.md).

Private runs (``add_private_runs``, a reload of experts no survivor holds: ``holders_reload``): per key one more
allocation per run, filled by the same ``fill_replica`` reader after setup, mapped read-only under this rank's
own handle index ``len(stored) + i`` and **never exported** (``_exported`` lists primary and replica handles only,
so the handle count peers expect never changes). Released with the rank's other allocations.

Elastic groups (``serve_exports=True``, issue #30): the exported handles stay served for the transport's life — the
fd server keeps running with its fds (fd transport), the handle bytes are kept (bytes transport) — and
``record(incarnation)`` says where (``elastic.records.MemberRecord``). A replacement of a lost rank imports the
members' memory from their records without any collective (``join_exchange``), and the members import its memory
from its record (``import_peer``) when it is admitted.

Invariant: keys are added in the same order on every rank (the manager registers layers in
forward order), so allocation i of rank r is the same (layer, weight) everywhere; handles of one
key are exported in handle order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from .fdpass import FdServer, fetch_fds
from .layout import HolderLayout, handle_bytes
from .memory.base import Allocation, MemoryBackend
from .rendezvous import Rendezvous

log = logging.getLogger(__name__)

#: fetching an admitted replacement's fds happens between two forwards of a serving rank: a live local fd server
#: answers in milliseconds (hundreds of fds); a frozen one must not hold the serving loop longer than this
IMPORT_PEER_TIMEOUT_S = 5.0


@dataclass
class _Entry:
    key: Hashable
    expert_bytes: int
    shape: tuple[int, ...]  # per-expert shape
    dtype: object
    allocs: list[Allocation]  # by handle index: 0 = primary range, j = replica run j-1
    reader: Callable[[object, int, int], None] | None = None  # fill_replica: experts [start, end) into a view
    private: list[Allocation] = field(default_factory=list)   # handle len(allocs) + i: reloaded run i, not exported

    @property
    def alloc(self) -> Allocation:
        return self.allocs[0]


def _close_fds(items) -> None:
    for item in items:
        if isinstance(item, int):
            os.close(item)


class Transport:
    def __init__(self, *, memory: MemoryBackend, rendezvous: Rendezvous, rank: int,
                 ranges: Sequence[tuple[int, int]], token_key: bytes, holders: HolderLayout | None = None,
                 serve_exports: bool = False):
        self.memory, self.rendezvous, self.rank = memory, rendezvous, rank
        self.ranges = tuple(ranges)
        self.holders = holders or HolderLayout(self.ranges, tuple(() for _ in self.ranges))
        if self.holders.primary != self.ranges:
            raise ValueError(f"holder layout {self.holders.primary} does not match the ranges {self.ranges}")
        self._token_key = token_key
        self._entries: list[_Entry] = []
        self._index: dict[Hashable, int] = {}
        self._peer_allocs: dict[int, list[Allocation]] = {}
        self._peer_views: dict[tuple[int, Hashable, int], tuple[int, int]] = {}  # (peer, key, handle) -> (va, nbytes)
        self._exchanged = False
        self._released = False
        self.serve_exports = serve_exports
        self._server: FdServer | None = None   # elastic, fd transport: serves the exports for the transport's life
        self._served_fds: list[int] = []
        self._exported_bytes: list[bytes] = []  # elastic, bytes transport: the exports, for the member record

    @property
    def num_local(self) -> int:
        a, b = self.ranges[self.rank]
        return b - a

    def add(self, key: Hashable, *, expert_shape: tuple[int, ...], dtype, expert_bytes: int,
            fill: Callable[[object], None],
            fill_replica: Callable[[object, int, int], None] | None = None) -> None:
        if self._exchanged:
            raise RuntimeError("cannot add weights after the handle exchange")
        if key in self._index:
            raise ValueError(f"weight {key!r} added twice")
        runs = self.holders.replicas[self.rank]
        if runs and fill_replica is None:
            raise ValueError(f"weight {key!r}: this rank stores replica runs {list(runs)} (expert_replicas > 1) "
                             f"and needs fill_replica(view, start, end) to write them")
        fills = [(self.num_local, fill)] + [(b - a, (lambda v, a=a, b=b: fill_replica(v, a, b))) for a, b in runs]
        allocs: list[Allocation] = []
        try:
            for n, fill_one in fills:
                allocs.append(self._create_filled(n, expert_shape, dtype, expert_bytes, fill_one))
        except BaseException:
            for alloc in allocs:
                self.memory.release(alloc)
            raise
        self._index[key] = len(self._entries)
        self._entries.append(_Entry(key, expert_bytes, tuple(expert_shape), dtype, allocs, fill_replica))

    def _create_filled(self, num: int, expert_shape, dtype, expert_bytes: int, fill) -> Allocation:
        nbytes = handle_bytes(num, expert_bytes, self.memory.granularity)
        alloc = self.memory.create(nbytes)
        va = None
        try:
            va = self.memory.reserve(nbytes)
            self.memory.map(va, alloc)
            self.memory.set_access(va, nbytes, writable=True)
            view = self.memory.as_tensor(va, (num, *expert_shape), dtype)
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
        return alloc

    def local_allocation(self, key: Hashable) -> Allocation:
        return self._entries[self._index[key]].alloc

    def peer_view(self, peer: int, key: Hashable, handle: int = 0) -> int:
        """Base address of ``peer``'s allocation ``handle`` for ``key`` in this process (read-only);
        ``peer`` may be this rank for its own replica runs (handle ≥ 1)."""
        try:
            return self._peer_views[(peer, key, handle)][0]
        except KeyError:
            raise KeyError(f"no view of rank {peer}'s handle {handle} of {key!r} (not imported, or the peer "
                           f"was dropped)") from None

    @property
    def imported_peers(self) -> set[int]:
        """Peers whose memory this process maps now."""
        return set(self._peer_allocs)

    def drop_peer(self, peer: int) -> None:
        """Unmap and release every view of ``peer`` (a lost rank): no address of its memory remains here."""
        if peer == self.rank:
            raise ValueError("a rank cannot drop itself")
        for k in [k for k in self._peer_views if k[0] == peer]:
            va, nbytes = self._peer_views.pop(k)
            self.memory.unmap(va, nbytes)
            self.memory.free_reservation(va, nbytes)
        for alloc in self._peer_allocs.pop(peer, []):
            self.memory.release(alloc)

    def add_private_runs(self, runs: Sequence[tuple[int, int]]) -> int:
        """Allocate, fill (``fill_replica``) and map read-only one private allocation per key and run (module
        docstring); returns the bytes allocated. Handle index of run i: this key's handle count before + i. All
        or nothing: on any failure what this call created is released, and ``holders_reload.ReloadRefused``
        names the cause (the memory backend's refusal, a reader's error) and the bytes it needed."""
        from .holders_reload import ReloadRefused, private_bytes

        if not self._exchanged or self._released:
            raise RuntimeError("private runs are added to a running transport (after the exchange, before release)")
        missing = [e.key for e in self._entries if e.reader is None]
        if missing:
            raise ReloadRefused(f"no checkpoint reader for {missing[:3]} (the experts were given as tensors, "
                                f"not as fill(view, start, end)): cannot reload experts {list(runs)}")
        need = private_bytes(runs, [e.expert_bytes for e in self._entries], self.memory.granularity)
        made: list[tuple[_Entry, Allocation, tuple]] = []   # (entry, allocation, view key)
        try:
            for entry in self._entries:
                for a, b in runs:
                    alloc = self._create_filled(b - a, entry.shape, entry.dtype, entry.expert_bytes,
                                                lambda v, a=a, b=b, r=entry.reader: r(v, a, b))
                    handle = len(entry.allocs) + len(entry.private)
                    entry.private.append(alloc)
                    made.append((entry, alloc, (self.rank, entry.key, handle)))
                    self._map_view(self.rank, entry.key, handle, alloc,
                                   handle_bytes(b - a, entry.expert_bytes, self.memory.granularity))
        except BaseException as exc:
            for entry, alloc, key in reversed(made):
                view = self._peer_views.pop(key, None)
                if view is not None:
                    self.memory.unmap(*view)
                    self.memory.free_reservation(*view)
                entry.private.remove(alloc)
                self.memory.release(alloc)
            if isinstance(exc, Exception):
                raise ReloadRefused(f"reloading experts {list(runs)} ({need / 2**20:.1f} MiB on the {self.memory.name} "
                                    f"backend) failed: {type(exc).__name__}: {exc}") from exc
            raise
        return need

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
            self._map_own_replicas()
            self.rendezvous.barrier("transport/imported")
        except BaseException:
            self.release(barrier=False)
            raise

    def _peer_handles(self, peer: int) -> list[tuple[_Entry, int, int]]:
        """``(entry, handle, nbytes)`` of every allocation ``peer`` exports, in export order."""
        runs = self.holders.stored(peer)
        return [(e, h, handle_bytes(b - a, e.expert_bytes, self.memory.granularity))
                for e in self._entries for h, (a, b) in enumerate(runs)]

    def _import_all(self, peer: int, shareables: list, progress) -> None:
        handles = self._peer_handles(peer)
        if len(shareables) != len(handles):
            _close_fds(shareables)
            raise RuntimeError(f"rank {peer} exported {len(shareables)} allocations, this rank expects "
                               f"{len(handles)}: ranks loaded different models or expert_replicas?")
        for i, ((entry, h, nbytes), shareable) in enumerate(zip(handles, shareables)):
            try:
                alloc = self.memory.import_(shareable, nbytes)  # consumes an fd
            except BaseException:
                _close_fds(shareables[i + 1:])
                raise
            self._peer_allocs.setdefault(peer, []).append(alloc)
            self._map_view(peer, entry.key, h, alloc, nbytes)
            if progress and h == 0:
                progress(1)

    def _map_view(self, peer: int, key: Hashable, handle: int, alloc: Allocation, nbytes: int) -> None:
        va = self.memory.reserve(nbytes)
        self.memory.map(va, alloc)
        self._peer_views[(peer, key, handle)] = (va, nbytes)
        self.memory.set_access(va, nbytes, writable=False)

    def _map_own_replicas(self) -> None:
        """Read-only views of this rank's own replica runs (it may be its own surviving source)."""
        for entry in self._entries:
            for h, alloc in enumerate(entry.allocs[1:], start=1):
                a, b = self.holders.replicas[self.rank][h - 1]
                self._map_view(self.rank, entry.key, h, alloc,
                               handle_bytes(b - a, entry.expert_bytes, self.memory.granularity))

    def _exported(self) -> list:
        return [self.memory.export(a) for e in self._entries for a in e.allocs]

    def _exchange_fds(self, peers: list[int], progress) -> None:
        exported = self._exported()
        server = None
        try:
            server = FdServer(exported, token_key=self._token_key)
            names = self.rendezvous.allgather("transport/fd-servers", server.name.encode())
            for peer in peers:
                self._import_all(peer, fetch_fds(names[peer].decode(), token_key=self._token_key), progress)
            self.rendezvous.barrier("transport/fds-fetched")
        finally:
            if server is not None and self.serve_exports and not self._released:
                self._server, self._served_fds = server, exported  # kept for replacements (module docstring)
            else:
                if server is not None:
                    server.close()
                _close_fds(exported)

    def _exchange_bytes(self, peers: list[int], progress) -> None:
        blobs = self._exported()
        if self.serve_exports:
            self._exported_bytes = blobs
        width = len(blobs[0]) if blobs else 0
        gathered = self.rendezvous.allgather("transport/handles", b"".join(blobs))
        for peer in peers:
            raw = gathered[peer]
            count = len(raw) // width if width else 0
            self._import_all(peer, [raw[i * width:(i + 1) * width] for i in range(count)], progress)

    # -- elastic groups: serve the exports, import from records (module docstring) ------------------------------
    def record(self, incarnation: str):
        """This rank's ``MemberRecord``: where its exported memory is fetched (after the exchange or the join). Without
        ``serve_exports`` it carries the incarnation only: nobody can import from it later."""
        from .elastic.records import MemberRecord

        if not self._exchanged:
            raise RuntimeError("a member record needs a finished exchange or join")
        if not self.serve_exports:
            return MemberRecord(self.rank, incarnation)
        if self.memory.handle_transport == "fd":
            return MemberRecord(self.rank, incarnation, fd_server=self._server.name if self._server else None)
        blobs = self._exported_bytes
        return MemberRecord(self.rank, incarnation, handles=b"".join(blobs), handle_width=len(blobs[0]) if blobs else 0)

    def import_peer(self, peer: int, record) -> None:
        """Map every allocation ``peer`` exports, as its record says where (an admitted replacement). Raises on any
        failure, with nothing of ``peer`` left mapped."""
        if peer == self.rank or peer in self._peer_allocs:
            raise ValueError(f"rank {peer} is this rank or still imported (drop_peer first)")
        try:
            if self.memory.handle_transport == "fd":
                if not record.fd_server:
                    raise RuntimeError(f"rank {peer}'s record names no fd server")
                self._import_all(peer, fetch_fds(record.fd_server, token_key=self._token_key,
                                                 timeout_s=IMPORT_PEER_TIMEOUT_S), None)
            else:
                self._import_all(peer, record.handle_list(), None)
        except BaseException:
            self.drop_peer(peer)
            raise

    def join_exchange(self, records: dict, *, progress: Callable[[int], None] | None = None) -> None:
        """A replacement's exchange: import every member's memory from its record, map its own replica runs, and
        serve its exports — no collective (the members are serving)."""
        if self._exchanged:
            raise RuntimeError("handles were already exchanged")
        if not self.serve_exports:
            raise RuntimeError("a join needs serve_exports=True (the members import this rank's memory later)")
        self._exchanged = True
        try:
            for peer in sorted(records):
                if peer != self.rank:
                    self.import_peer(peer, records[peer])
                    if progress:
                        progress(1)
            self._map_own_replicas()
            exported = self._exported()
            if self.memory.handle_transport == "fd":
                try:
                    self._server = FdServer(exported, token_key=self._token_key)
                except BaseException:
                    _close_fds(exported)
                    raise
                self._served_fds = exported
            else:
                self._exported_bytes = exported
        except BaseException:
            self.release(barrier=False)
            raise

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
        for allocs in self._peer_allocs.values():
            for alloc in allocs:
                self.memory.release(alloc)
        self._peer_views.clear()
        self._peer_allocs.clear()
        if barrier:
            try:
                self.rendezvous.barrier("transport/released")
            except Exception as exc:  # noqa: BLE001 - a dead peer must not block our teardown
                log.warning("release barrier failed (%s); releasing local allocations anyway", exc)
        if self._server is not None:
            self._server.close()
            self._server = None
        _close_fds(self._served_fds)
        self._served_fds = []
        for entry in self._entries:
            for alloc in [*entry.allocs, *entry.private]:
                self.memory.release(alloc)
        if errors:
            log.warning("errors while unmapping peer views: %s", errors[0])
