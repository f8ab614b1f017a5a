"""The bounded KV store of one rank: which blocks of the region hold which request, until when, and the
verdict on every pull (docs/KV_TRANSFER.md, "Why a verdict").

Life of an entry::

    put ──► HELD ──claim──► CLAIMED ──confirm (inside the lease)──► freed at once      verdict: valid
             │ TTL            │ lease lapses / abort
             ▼                ▼
           freed          freed into quarantine (grace_s) ──► free for a new sequence
                          any later confirm of this claim                           verdict: stale

``put`` (after the prefill; ``KvBudgetFull`` when the region has no room — the front answers 429);
``claim`` leases a HELD entry to one (decode agent, nonce) for ``lease_s``; ``confirm`` is the answer to
the decode side's ``pulled`` notification (sent by NIXL after its READ's data): **valid** only when this
very claim still holds the entry and its lease has not run out on this rank's clock, **stale** otherwise.
``sweep`` frees every HELD entry past its TTL and lapses every CLAIMED one past its lease.

Why this is enough: blocks of a CLAIMED entry are freed only by ``confirm`` (after the READ is done), by the
claim holder's ``abort``, or by a lapse. A READ's bytes are all read before its ``pulled`` notification
is sent, and ``confirm`` decides under the lock with the rank's own clock, so a valid verdict means the
blocks were never freed — let alone reused — between the claim and the end of the READ, whatever the
decode side's clock says. Every READ that may have raced a free (a lapse, an abort, a confirmation that
names another claim) gets a stale verdict; the blocks such a READ may still be reading sit in quarantine
for ``grace_s`` first, so it reads its own request's bytes rather than another tenant's (defence in
depth: the verdict alone keeps wrong KV from being used).

Invariants:
  * held bytes (allocated + quarantined) ≤ the region's capacity, always (the allocator never over-commits);
  * an entry's blocks are freed exactly once (every path removes the entry under the lock);
  * a request id is stored at most once at a time (a duplicate ``put`` is refused);
  * ``confirm`` never changes an entry it does not validate (a stranger's or an old claim's ``pulled``
    leaves the claim holder's KV and lease alone);
  * the last ``RECENT_FREED`` freed ids remember why they went and which claim held them, so a late claim
    gets "expired", "lapsed" or "already pulled" and a late confirmation its precise stale reason.
Thread-safe: the forward thread puts, the agent's notification thread claims/confirms/sweeps.
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
DEFAULT_LEASE_S = 30.0   # a claimed pull must be confirmed within this (a 5 GB sequence at 1 GB/s fits)
#: blocks a READ may still be reading (lapse, abort) wait this long before reuse: a READ in flight at the
#: lapse finishes on its own request's bytes (a 5 GB READ at 1 GB/s). Costs budget only after a lapse.
DEFAULT_GRACE_S = 5.0


class KvBudgetFull(RuntimeError):
    """No room in the KV region for this sequence (answer 429: retry later or elsewhere)."""


class EntryState(StrEnum):
    HELD = "held"
    CLAIMED = "claimed"


class Refusal(StrEnum):
    """Why a claim is refused (the ``reason`` of ``refused``)."""

    UNKNOWN = "unknown request id"
    EXPIRED = "expired (its TTL passed before a pull claimed it; it was freed)"
    LAPSED = "lapsed (a pull claimed it but did not confirm within its lease; it was freed)"
    PULLED = "already pulled (KV is freed once the decode side confirms)"
    CLAIMED = "claimed by another pull (another decode agent, or another claim of this one)"
    ABORTED = "aborted by the decode side"
    DISCARDED = "discarded by the context server before any pull claimed it"


class Stale(StrEnum):
    """Why a ``pulled`` confirmation is answered stale: whatever that READ returned must be discarded."""

    LAPSED = ("lease lapsed before this confirmation arrived: the blocks were freed and may hold another "
              "request's KV now")
    NOT_YOUR_CLAIM = "this pull does not hold the claim (another agent or another nonce holds it)"
    NOT_CLAIMED = "this request was never claimed by this pull (claim, wait for claimed, then READ)"
    RELEASED = "already confirmed and freed (a second READ of it may have read reused blocks)"
    ABORTED = "this pull aborted it; the blocks were freed"
    EXPIRED = "never claimed: its TTL passed and it was freed"
    UNKNOWN = "unknown request id"


@dataclass(frozen=True)
class Verdict:
    """The rank's answer to ``pulled``: ``valid`` (the bytes read are the request's KV) or ``stale``."""

    valid: bool
    stale: Stale | None = None


VALID = Verdict(valid=True)


@dataclass
class Entry:
    request_id: str
    block_ids: list[int]
    descs: list[KvTensorDesc]
    stream_bytes: int
    seq_len: int
    expires: float               # monotonic: TTL while HELD, lease end while CLAIMED
    expires_at: float            # wall clock, for the client (informational: the TTL travels as ttl_s too)
    state: EntryState = EntryState.HELD
    claimer: str = ""
    nonce: str = ""
    claimed_at: float = 0.0


@dataclass(frozen=True)
class Freed:
    """What a recently freed request id remembers: why, and which claim (if any) held it."""

    reason: Refusal
    claimer: str = ""
    nonce: str = ""


@dataclass
class ClaimResult:
    entry: Entry | None
    refusal: Refusal | None = None
    lease_s: float = 0.0         # lease left when the rank answered (the duration is what a decode side uses)
    lease_until: float = 0.0     # the same instant as this rank's wall clock (informational)


@dataclass
class KvStats:
    budget_bytes: int
    block_bytes: int
    held_bytes: int = 0               # allocated + quarantined blocks
    held_sequences: int = 0
    quarantined_bytes: int = 0        # blocks waiting out the grace period after a lapse or an abort
    stored_total: int = 0
    pulls_total: int = 0              # confirmed valid
    pulled_bytes_total: int = 0
    pull_seconds_total: float = 0.0   # claim → completion notification, summed
    expirations_total: int = 0        # TTL expiries and lapsed leases
    refusals_total: int = 0
    stale_total: int = 0              # pulled confirmations answered stale
    full_total: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class KvStore:
    region: KvRegion
    ttl_s: float = DEFAULT_TTL_S
    lease_s: float = DEFAULT_LEASE_S
    grace_s: float = DEFAULT_GRACE_S
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _entries: dict[str, Entry] = field(default_factory=dict)
    _freed: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.lease_s <= 0 or self.grace_s < 0:
            raise ValueError(f"KV TTL and lease must be > 0 s, the grace >= 0 s (got {self.ttl_s}, {self.lease_s}, "
                             f"{self.grace_s})")
        self._stats = KvStats(budget_bytes=self.region.capacity_bytes, block_bytes=self.region.block_bytes)

    def put(self, request_id: str, kv, seq_len: int) -> Entry:
        """Copy one sequence's per-layer ``(key, value)`` tensors into the region."""
        descs, stream_bytes = plan_for(kv)
        need = self.region.blocks_for(stream_bytes)
        alloc = self.region.allocator
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"KV for request {request_id!r} is already stored")
            alloc.thaw(self.clock())
            ids = alloc.allocate(need)
            if ids is None:
                self._stats.full_total += 1
                free, waiting = alloc.num_free * self.region.block_bytes, alloc.num_quarantined * self.region.block_bytes
                raise KvBudgetFull(f"KV budget full: this sequence needs {need * self.region.block_bytes} B, "
                                   f"{free} B of {self.region.capacity_bytes} B are free"
                                   + (f" ({waiting} B wait out a lapsed pull's grace period)" if waiting else "")
                                   + "; retry later")
        try:
            self.region.write(ids, descs, kv, stream_bytes)
        except BaseException:
            with self._lock:
                alloc.free(ids)
            raise
        now, wall = self.clock(), self.wall()
        entry = Entry(request_id=request_id, block_ids=ids, descs=descs, stream_bytes=stream_bytes, seq_len=seq_len,
                      expires=now + self.ttl_s, expires_at=wall + self.ttl_s)
        with self._lock:
            self._entries[request_id] = entry
            self._stats.stored_total += 1
        return entry

    def claim(self, request_id: str, claimer: str, nonce: str) -> ClaimResult:
        """Lease a HELD entry to (``claimer``, ``nonce``); a repeated claim of the same pull gets its lease back
        (never extended)."""
        with self._lock:
            now = self.clock()
            e = self._entries.get(request_id)
            if e is not None and now >= e.expires:          # due for the sweep: it is gone for every caller
                self._expire(e)
                e = None
            if e is None:
                gone = self._freed.get(request_id)
                self._stats.refusals_total += 1
                return ClaimResult(None, gone.reason if gone else Refusal.UNKNOWN)
            if e.state is EntryState.CLAIMED and (e.claimer, e.nonce) != (claimer, nonce):
                self._stats.refusals_total += 1
                return ClaimResult(None, Refusal.CLAIMED)
            if e.state is EntryState.HELD:
                e.state, e.claimer, e.nonce, e.claimed_at = EntryState.CLAIMED, claimer, nonce, now
                e.expires = now + self.lease_s
            left = e.expires - now
            return ClaimResult(e, None, lease_s=left, lease_until=self.wall() + left)

    def confirm(self, request_id: str, claimer: str, nonce: str) -> Verdict:
        """The verdict on a ``pulled`` notification (see the module docstring); valid frees the blocks at once."""
        with self._lock:
            now = self.clock()
            e = self._entries.get(request_id)
            if e is not None and now >= e.expires:          # lapsed (or expired) on this rank's clock
                self._expire(e)
                e = None
            if e is not None:
                if e.state is EntryState.HELD:
                    return self._stale(Stale.NOT_CLAIMED)
                if (e.claimer, e.nonce) != (claimer, nonce):
                    return self._stale(Stale.NOT_YOUR_CLAIM)
                self._stats.pulls_total += 1
                self._stats.pulled_bytes_total += e.stream_bytes
                self._stats.pull_seconds_total += max(0.0, now - e.claimed_at)
                self._drop(e, Freed(Refusal.PULLED, claimer, nonce), quarantine=False)
                return VALID
            gone = self._freed.get(request_id)
            if gone is None:
                return self._stale(Stale.UNKNOWN)
            if (gone.claimer, gone.nonce) != (claimer, nonce):
                return self._stale(Stale.NOT_YOUR_CLAIM if gone.claimer else Stale.NOT_CLAIMED)
            return self._stale({Refusal.LAPSED: Stale.LAPSED, Refusal.PULLED: Stale.RELEASED,
                                Refusal.ABORTED: Stale.ABORTED}.get(gone.reason, Stale.EXPIRED))

    def abort(self, request_id: str, claimer: str, nonce: str) -> bool:
        """The claim holder gives up: free (into quarantine: its READ may still run). False if not its claim."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.state is not EntryState.CLAIMED or (e.claimer, e.nonce) != (claimer, nonce):
                return False
            self._drop(e, Freed(Refusal.ABORTED, claimer, nonce), quarantine=True)
            return True

    def discard(self, request_id: str) -> bool:
        """The rank's own free of a sequence nobody claimed (tests, warm-ups); False if absent or claimed."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.state is not EntryState.HELD:
                return False
            self._drop(e, Freed(Refusal.DISCARDED), quarantine=False)
            return True

    def sweep(self) -> list[str]:
        """Free every entry past its TTL, lapse every claim past its lease, end grace periods; the ids freed."""
        now = self.clock()
        with self._lock:
            gone = [e for e in self._entries.values() if now >= e.expires]
            for e in gone:
                self._expire(e)
            self.region.allocator.thaw(now)
        return [e.request_id for e in gone]

    # -- under the lock ----------------------------------------------------------------------------------
    def _stale(self, why: Stale) -> Verdict:
        self._stats.stale_total += 1
        return Verdict(valid=False, stale=why)

    def _expire(self, e: Entry) -> None:
        self._stats.expirations_total += 1
        if e.state is EntryState.CLAIMED:               # a READ of this claim may be in flight: quarantine
            self._drop(e, Freed(Refusal.LAPSED, e.claimer, e.nonce), quarantine=True)
        else:
            self._drop(e, Freed(Refusal.EXPIRED), quarantine=False)

    def _drop(self, e: Entry, why: Freed, *, quarantine: bool) -> None:
        del self._entries[e.request_id]
        if quarantine and self.grace_s > 0:
            self.region.allocator.quarantine(e.block_ids, self.clock() + self.grace_s)
        else:
            self.region.allocator.free(e.block_ids)
        self._freed[e.request_id] = why
        self._freed.move_to_end(e.request_id)
        while len(self._freed) > RECENT_FREED:
            self._freed.popitem(last=False)

    # -- views --------------------------------------------------------------------------------------------
    def get(self, request_id: str) -> Entry | None:
        with self._lock:
            return self._entries.get(request_id)

    def stats(self) -> KvStats:
        with self._lock:
            alloc, bb = self.region.allocator, self.region.block_bytes
            s = KvStats(**self._stats.as_dict())
            s.held_sequences = len(self._entries)
            s.held_bytes = (self.region.num_blocks - alloc.num_free) * bb
            s.quarantined_bytes = alloc.num_quarantined * bb
            return s
