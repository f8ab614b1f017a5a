"""PeerMonitor: notice, within a bounded time, that a rank of the group died. Off the forward path.

Why: a rank reads its peers' expert memory directly. On a single node (memfd / POSIX fd) an
imported allocation outlives its exporter, but across nodes (fabric/IMEX) a dead exporter's memory
can vanish under the reader, and in any case a group with a dead rank is being restarted by the
operator. So each rank must stop serving promptly and say why, instead of computing on stale or
unmapped weights or hanging.

How: a daemon thread heart-beats ``alive/<rank>`` (a monotonically increasing counter) in the
group's rendezvous store every ``interval_s`` and reads every peer's counter. A peer whose counter
has not moved for ``dead_after_s`` is declared lost; losing the store itself (rank 0 hosts it) is a
loss too. This is a few tiny store ops per second on a side thread — no collective, nothing on the
forward path. ``check()`` raises ``PeerLost`` with the rank and the age of its last heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time

from .rendezvous import StoreRendezvous

log = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A rank of this DWDP group (or the group's store) stopped answering."""


class PeerMonitor:
    def __init__(self, rendezvous: StoreRendezvous, *, interval_s: float = 1.0, dead_after_s: float = 10.0):
        if dead_after_s <= 2 * interval_s:
            raise ValueError(f"dead_after_s={dead_after_s} must exceed two heartbeat intervals ({interval_s} s)")
        self._rdzv = rendezvous
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self._lost: str | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (last counter, when it last changed)
        self._thread = threading.Thread(target=self._run, name="dwdp-peer-monitor", daemon=True)

    def start(self) -> "PeerMonitor":
        self._thread.start()
        return self

    @property
    def lost(self) -> str | None:
        return self._lost

    def check(self) -> None:
        if self._lost:
            raise PeerLost(self._lost)

    def _run(self) -> None:
        r = self._rdzv
        beat = 0
        while not self._stop.is_set():
            beat += 1
            now = time.monotonic()
            try:
                r.store_set(f"alive/{r.rank}", str(beat).encode())
                for peer in range(r.world_size):
                    if peer == r.rank:
                        continue
                    raw = r.store_get_nowait(f"alive/{peer}")
                    count = int(raw) if raw else 0
                    last, since = self._seen.get(peer, (-1, now))
                    if count != last:
                        self._seen[peer] = (count, now)
                    elif now - since > self.dead_after_s:
                        self._fail(f"rank {peer} of {r.where} stopped heart-beating {now - since:.1f} s ago "
                                   f"(dead or hung); this group must be restarted")
                        return
            except Exception as exc:  # noqa: BLE001 - the store (rank 0) is gone
                if not self._stop.is_set():
                    self._fail(f"lost the rendezvous store of {r.where} ({exc}); rank 0 hosts it and "
                               f"probably died; this group must be restarted")
                return
            self._stop.wait(self.interval_s)

    def _fail(self, message: str) -> None:
        self._lost = message
        log.error("%s", message)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 5)
