"""The bounded KV store of one rank: which blocks of the region hold which request, until when.

Life of an entry: ``put`` (after the prefill; ``KvBudgetFull`` when the region has no room — the front
answers 429) → ``HELD`` until ``ttl_s`` → a decode agent's ``claim`` turns it ``CLAIMED`` with a lease
(``lease_s``: the TTL no longer applies, a pull in flight is never freed under it) → ``release`` on the
READ's completion notification frees the blocks at once. ``sweep`` frees every HELD entry past its TTL
and every CLAIMED one past its lease (a decode side that died mid-pull) and counts them as expirations.

Invariants:
  * held bytes ≤ the region's capacity, always (the allocator never over-commits);
  * an entry's blocks are freed exactly once (``release`` and ``sweep`` both remove it under the lock);
  * a request id is stored at most once at a time (a duplicate ``put`` is refused);
  * the last ``RECENT_FREED`` freed ids remember why they went (pulled / expired), so a late pull gets
    "expired" or "already pulled" rather than "unknown".
Thread-safe: the forward thread puts, the agent's notification thread claims/releases/sweeps.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from .layout import plan_for
from .params import KvTensorDesc
from .region import KvRegion

#: freed request ids remembered for clear late-pull errors (bounded: ids are ~40 bytes)
RECENT_FREED = 4096
DEFAULT_TTL_S = 30.0     # unclaimed KV lives this long: a decode engine pulls within ms..s of the answer
DEFAULT_LEASE_S = 30.0   # a claimed pull must complete within this (a 5 GB sequence at 1 GB/s fits)


class KvBudgetFull(RuntimeError):
    """No room in the KV region for this sequence (answer 429: retry later or elsewhere)."""


class EntryState(StrEnum):
    HELD = "held"
    CLAIMED = "claimed"


class Refusal(StrEnum):
    UNKNOWN = "unknown request id"
    EXPIRED = "expired (its TTL passed before a pull claimed it; it was freed)"
    PULLED = "already pulled (KV is freed once the decode side confirms)"
    CLAIMED = "claimed by another decode agent"
    ABORTED = "aborted by the decode side"


@dataclass
class Entry:
    request_id: str
    block_ids: list[int]
    descs: list[KvTensorDesc]
    stream_bytes: int
    seq_len: int
    expires: float               # monotonic
    expires_at: float            # wall clock, for the client
    state: EntryState = EntryState.HELD
    claimer: str = ""
    nonce: str = ""
    claimed_at: float = 0.0


@dataclass
class ClaimResult:
    entry: Entry | None
    refusal: Refusal | None = None
    lease_until: float = 0.0     # wall clock


@dataclass
class KvStats:
    budget_bytes: int
    block_bytes: int
    held_bytes: int = 0
    held_sequences: int = 0
    stored_total: int = 0
    pulls_total: int = 0
    pulled_bytes_total: int = 0
    pull_seconds_total: float = 0.0   # claim → completion notification, summed
    expirations_total: int = 0
    refusals_total: int = 0
    full_total: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class KvStore:
    region: KvRegion
    ttl_s: float = DEFAULT_TTL_S
    lease_s: float = DEFAULT_LEASE_S
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _entries: dict[str, Entry] = field(default_factory=dict)
    _freed: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.lease_s <= 0:
            raise ValueError(f"KV TTL and lease must be > 0 s (got {self.ttl_s}, {self.lease_s})")
        self._stats = KvStats(budget_bytes=self.region.capacity_bytes, block_bytes=self.region.block_bytes)

    def put(self, request_id: str, kv, seq_len: int) -> Entry:
        """Copy one sequence's per-layer ``(key, value)`` tensors into the region."""
        descs, stream_bytes = plan_for(kv)
        need = self.region.blocks_for(stream_bytes)
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"KV for request {request_id!r} is already stored")
            ids = self.region.allocator.allocate(need)
            if ids is None:
                self._stats.full_total += 1
                free = self.region.allocator.num_free * self.region.block_bytes
                raise KvBudgetFull(f"KV budget full: this sequence needs {need * self.region.block_bytes} B, "
                                   f"{free} B of {self.region.capacity_bytes} B are free; retry later")
        try:
            self.region.write(ids, descs, kv, stream_bytes)
        except BaseException:
            with self._lock:
                self.region.allocator.free(ids)
            raise
        now, wall = self.clock(), self.wall()
        entry = Entry(request_id=request_id, block_ids=ids, descs=descs, stream_bytes=stream_bytes, seq_len=seq_len,
                      expires=now + self.ttl_s, expires_at=wall + self.ttl_s)
        with self._lock:
            self._entries[request_id] = entry
            self._stats.stored_total += 1
        return entry

    def claim(self, request_id: str, claimer: str, nonce: str) -> ClaimResult:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or (e.state is EntryState.HELD and self.clock() >= e.expires):
                if e is not None:
                    self._drop(e, expired=True)
                refusal = self._freed.get(request_id, Refusal.UNKNOWN)
                self._stats.refusals_total += 1
                return ClaimResult(None, refusal)
            if e.state is EntryState.CLAIMED and (e.claimer, e.nonce) != (claimer, nonce):
                self._stats.refusals_total += 1
                return ClaimResult(None, Refusal.CLAIMED)
            e.state, e.claimer, e.nonce, e.claimed_at = EntryState.CLAIMED, claimer, nonce, self.clock()
            e.expires = e.claimed_at + self.lease_s
            return ClaimResult(e, None, lease_until=self.wall() + self.lease_s)

    def release(self, request_id: str, *, claimer: str | None = None, nonce: str | None = None,
                pulled: bool) -> bool:
        """Free now (``pulled``: the decode side confirmed a completed READ). False if not held (or not its claim)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or (claimer is not None and (e.claimer, e.nonce) != (claimer, nonce)):
                return False
            if pulled:
                self._stats.pulls_total += 1
                self._stats.pulled_bytes_total += e.stream_bytes
                self._stats.pull_seconds_total += max(0.0, self.clock() - e.claimed_at)
            self._drop(e, expired=False, reason=Refusal.PULLED if pulled else Refusal.ABORTED)
            return True

    def sweep(self) -> list[str]:
        """Free every entry past its TTL (or its lease, when claimed); returns their ids."""
        now = self.clock()
        with self._lock:
            gone = [e for e in self._entries.values() if now >= e.expires]
            for e in gone:
                self._drop(e, expired=True)
        return [e.request_id for e in gone]

    def _drop(self, e: Entry, *, expired: bool, reason: Refusal | None = None) -> None:
        del self._entries[e.request_id]
        self.region.allocator.free(e.block_ids)
        if expired:
            self._stats.expirations_total += 1
        self._freed[e.request_id] = Refusal.EXPIRED if expired else reason
        while len(self._freed) > RECENT_FREED:
            self._freed.popitem(last=False)

    def get(self, request_id: str) -> Entry | None:
        with self._lock:
            return self._entries.get(request_id)

    def stats(self) -> KvStats:
        with self._lock:
            s = KvStats(**self._stats.as_dict())
            s.held_sequences = len(self._entries)
            s.held_bytes = (self.region.num_blocks - self.region.allocator.num_free) * self.region.block_bytes
            return s
