"""PeerMonitor: notice, within a bounded time, that a rank of the group (or its store) is gone. Off the forward path.

Why: a rank reads its peers' expert memory directly. On a single node (memfd / POSIX fd) an
imported allocation outlives its exporter, but across nodes (fabric/IMEX) a dead exporter's memory
can vanish under the reader, and in any case a group with a dead rank is being restarted by the
operator. So each rank must stop serving promptly and say why, instead of computing on stale or
unmapped weights or hanging.

How — two daemon threads, so that no verdict ever waits on the network:
  * the *beat* thread does the store I/O: every ``interval_s`` it writes ``alive/<rank>`` (an
    increasing counter) in the group's rendezvous store, reads every peer's counter, and records
    what it saw and when the round finished. A store call can block for as long as the TCPStore's
    own timeout (minutes) when the store host is frozen (SIGSTOP, a hung node: the kernel still
    accepts the connection, nobody answers) — only this thread waits then;
  * the *watch* thread never touches the store: every ``interval_s`` it judges the records
    (``verdict``, a pure function): a store that has not completed a round for ``dead_after_s``, or a
    peer whose counter stood still over ``dead_after_s`` of completed rounds, is lost. ``on_lost(message)`` is
    called once, from the watch thread (the rank reports it to its front at once, even mid-forward).

Detection bound: a peer or store that stops answering at time t is declared lost by
t + ``dead_after_s`` + 2 × ``interval_s`` (the round in flight, then one watch tick), whatever the
store calls do. ``check()`` (the rank's serving loop) raises ``PeerLost`` with the same message.

Elastic mode (``elastic=True``, issue #30: a group with expert replicas survives a rank loss): a
silent *peer* is not fatal; it is added to ``lost_ranks`` (``dead_peers``, pure) and the watch goes
on judging the others — ``elastic.agent.MembershipAgent`` turns it into a new membership epoch, and
``readmit`` takes a rank back when its replacement joins. A lost or frozen *store* is handed to
``on_store_lost`` (the agent's failover to a survivor's standby store, ``elastic.store_chain``): while it
runs nothing is judged lost; ``resume(lost_host)`` then starts a fresh beat thread on the new store with a
fresh bound for every peer (the old thread may stay blocked on the frozen store forever: it is abandoned,
and its late return is ignored by its generation token), or ``fail(why)`` makes the loss fatal after all.
Without ``on_store_lost`` (or when it declines) a lost store is fatal, as in a static group.

Beats are ``<tag>:<counter>`` (the tag: the process's incarnation), so a replacement's beats read as movement
even when its counter meets the old one's.

A process that was itself stopped (SIGSTOP, a VM pause) must not blame the others for its own silence:
when two judgements are more than ``dead_after_s`` apart, this process was frozen, and every record
restarts from the wake-up time (a fresh bound for the store and each peer; found by the SIGSTOP test of
tests/runtime/test_elastic.py: a woken rank declared the live store lost).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .rendezvous import StoreRendezvous

log = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A rank of this DWDP group (or the group's store) stopped answering."""


@dataclass
class Observations:
    """What the beat thread has seen (written by it, read by the watch thread; replaced, never mutated)."""

    started: float                                                # monotonic time the monitor started
    last_round: float                                             # when the last full store round finished
    peers: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # peer → (beat, when it last moved)
    store_error: str | None = None                                # the store call raised (connection lost)


def dead_peers(obs: Observations, *, dead_after_s: float) -> tuple[int, ...]:
    """Peers whose counter stood still over more than ``dead_after_s`` of completed rounds (pure)."""
    return tuple(p for p, (_, since) in sorted(obs.peers.items()) if obs.last_round - since > dead_after_s)


def store_verdict(obs: Observations, now: float, *, dead_after_s: float, where: str) -> str | None:
    """Why the group's store is lost (a message), or ``None`` (pure)."""
    return verdict(Observations(obs.started, obs.last_round, {}, obs.store_error), now,
                   dead_after_s=dead_after_s, where=where)


def verdict(obs: Observations, now: float, *, dead_after_s: float, where: str) -> str | None:
    """Why the group is broken (a message), or ``None``. Pure: the watch thread's whole judgement."""
    if obs.store_error is not None:
        return (f"lost the rendezvous store of {where} ({obs.store_error}); rank 0 hosts it and "
                f"probably died; this group must be restarted")
    silent = now - obs.last_round
    if silent > dead_after_s:
        return (f"the rendezvous store of {where} has not answered for {silent:.1f} s (its host, rank 0, is "
                f"frozen or unreachable); this group must be restarted")
    # a peer is blamed only for silence the store could have carried: its counter stood still over rounds that
    # completed. Judged against ``now``, a frozen store host's own last beat — up to one interval older than
    # the last round — would cross the bound first and blame the peer for the store's silence.
    for peer, (_, since) in sorted(obs.peers.items()):
        if obs.last_round - since > dead_after_s:
            return (f"rank {peer} of {where} stopped heart-beating {now - since:.1f} s ago "
                    f"(dead or hung); this group must be restarted")
    return None


class PeerMonitor:
    def __init__(self, rendezvous: StoreRendezvous, *, interval_s: float = 1.0, dead_after_s: float = 10.0,
                 on_lost: Callable[[str], None] | None = None, elastic: bool = False, beat_tag: str = "",
                 on_store_lost: Callable[[str], bool] | None = None):
        if dead_after_s <= 2 * interval_s:
            raise ValueError(f"dead_after_s={dead_after_s} must exceed two heartbeat intervals ({interval_s} s)")
        self._rdzv = rendezvous
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self._on_lost = on_lost
        self.elastic = elastic
        self.beat_tag = beat_tag
        # elastic mode: called once per store loss (from the watch thread; it must return at once); True = a failover
        # runs and will call resume() or fail(); False = the loss is fatal
        self.on_store_lost = on_store_lost
        self._failing_over = False
        self._lost_ranks: frozenset[int] = frozenset()  # elastic mode: silent peers (replaced, never mutated)
        self._lost: str | None = None
        self._lost_lock = threading.Lock()
        self._last_judged: float | None = None
        self._stop = threading.Event()
        self._beat_token = 0  # the beat thread's generation: a thread of an older one exits when it next wakes
        # peer → (its latest beat, monotonic time it last changed as this process saw it change): never reset by a
        # failover or a wake-up, so a dead process's last beat never passes for a live one (``moving``)
        self._moved: dict[int, tuple[bytes, float]] = {}
        now = time.monotonic()
        self._obs = Observations(started=now, last_round=now)
        self._watch = threading.Thread(target=self._watch_loop, name="dwdp-peer-monitor", daemon=True)

    def start(self) -> "PeerMonitor":
        now = time.monotonic()
        self._obs = Observations(started=now, last_round=now)
        self._start_beats()
        self._watch.start()
        return self

    def _start_beats(self) -> None:
        self._beat_token += 1
        threading.Thread(target=self._beat_loop, args=(self._beat_token,), name="dwdp-peer-beat", daemon=True).start()

    @property
    def lost(self) -> str | None:
        return self._lost

    @property
    def lost_ranks(self) -> frozenset[int]:
        """Elastic mode: the peers found silent and not readmitted since (a snapshot)."""
        return self._lost_ranks

    @property
    def failing_over(self) -> bool:
        return self._failing_over

    def check(self) -> None:
        """Raise ``PeerLost`` if the group is broken (judged now, without touching the store)."""
        self._judge()
        if self._lost:
            raise PeerLost(self._lost)

    # -- elastic mode: after a failover, a replacement, or no failover after all -----------------------------
    def resume(self, lost_host: int | None) -> None:
        """The store moved (``rendezvous.switch_to``): beat there from a fresh thread, judge every peer afresh from
        now, and count the old store's host as lost (``None``: it was this rank, or is not a peer)."""
        now = time.monotonic()
        obs = self._obs
        self._obs = Observations(obs.started, now, {p: (b, now) for p, (b, _) in obs.peers.items()})
        if lost_host is not None and lost_host != self._rdzv.rank:
            self._lost_ranks = self._lost_ranks | {lost_host}
        self._failing_over = False
        self._start_beats()

    def readmit(self, rank: int) -> None:
        """``rank`` serves again (its replacement joined): judge it afresh from now."""
        self._lost_ranks = self._lost_ranks - {rank}
        obs = self._obs
        peers = dict(obs.peers)
        peers[rank] = (peers.get(rank, (b"", 0.0))[0], time.monotonic())
        self._obs = Observations(obs.started, obs.last_round, peers, obs.store_error)

    def moving(self, rank: int) -> bytes | None:
        """``rank``'s latest beat if this process saw it change within ``dead_after_s``, else ``None`` (a replacement
        asking to join must be beating: ``elastic.agent``)."""
        seen = self._moved.get(rank)
        if seen is None or time.monotonic() - seen[1] > self.dead_after_s:
            return None
        return seen[0]

    def fail(self, why: str) -> None:
        """The group cannot go on (a failover found no store): the loss is fatal, ``on_lost`` is told."""
        self._declare(why)

    # -- beat thread: the only one that talks to the store ------------------------------------------------
    def _beat_loop(self, token: int) -> None:
        r = self._rdzv
        beat = 0
        peers = {p: (self._obs.peers.get(p, (b"", 0.0))[0], time.monotonic()) for p in range(r.world_size)
                 if p != r.rank}
        while not self._stop.is_set() and token == self._beat_token:
            beat += 1
            try:
                r.store_set(f"alive/{r.rank}", f"{self.beat_tag}:{beat}".encode())
                seen = {peer: r.store_get_nowait(f"alive/{peer}") or b"" for peer in peers}
            except Exception as exc:  # noqa: BLE001 - the store (its host) is gone
                if not self._stop.is_set() and token == self._beat_token:
                    self._obs = Observations(self._obs.started, self._obs.last_round, dict(self._obs.peers), str(exc))
                    self._judge()
                return
            if token != self._beat_token:
                return  # a failover replaced this thread while it was blocked: its view is of the old store
            now = time.monotonic()
            for p, b in seen.items():
                before = self._moved.get(p)
                if b and (before is None or before[0] != b):
                    self._moved[p] = (b, now if before is not None else float("-inf"))  # a first read is no change
            current = self._obs.peers
            peers = {p: ((b, now) if b != current.get(p, peers[p])[0] else current.get(p, peers[p]))
                     for p, b in seen.items()}
            self._obs = Observations(self._obs.started, now, dict(peers))
            self._stop.wait(self.interval_s)

    # -- watch thread: judges, never blocks --------------------------------------------------------------
    def _watch_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._judge():
                return

    def _judge(self) -> bool:
        if self._lost is not None:
            return True
        now = time.monotonic()
        if self._last_judged is not None and now - self._last_judged > self.dead_after_s:
            obs = self._obs  # this process was frozen: nobody else's silence can be judged from before it
            self._obs = Observations(obs.started, now, {p: (c, now) for p, (c, _) in obs.peers.items()}, obs.store_error)
            log.warning("this process was stopped for %.1f s: peer and store records restart now", now - self._last_judged)
        self._last_judged = now
        if not self.elastic:
            why = verdict(self._obs, time.monotonic(), dead_after_s=self.dead_after_s, where=self._rdzv.where)
            return why is not None and self._declare(why)
        if self._failing_over:
            return False  # the old store's records mean nothing until resume() (or fail())
        obs = self._obs
        dead = frozenset(dead_peers(obs, dead_after_s=self.dead_after_s)) - self._lost_ranks
        if dead:
            log.warning("rank(s) %s of %s stopped heart-beating (elastic group: survivors re-plan)",
                        sorted(dead), self._rdzv.where)
            self._lost_ranks = self._lost_ranks | dead
        why = store_verdict(obs, time.monotonic(), dead_after_s=self.dead_after_s, where=self._rdzv.where)
        if why is None:
            return False
        if self.on_store_lost is not None and not self._stop.is_set():
            self._failing_over = True
            try:
                if self.on_store_lost(why):
                    log.warning("%s: failing over to a standby store", why)
                    return False
            except Exception:  # noqa: BLE001 - a failing failover hook leaves the loss fatal
                log.exception("the store failover could not start")
            self._failing_over = False
        return self._declare(why)

    def _declare(self, why: str) -> bool:
        with self._lost_lock:
            if self._lost is not None:
                return True
            self._lost = why
        log.error("%s", why)
        if self._on_lost is not None and not self._stop.is_set():
            try:
                self._on_lost(why)
            except Exception:  # noqa: BLE001 - reporting must not kill the watcher
                log.exception("on_lost callback failed")
        return True

    def stop(self) -> None:
        """Stop both threads. Joins the watch thread (bounded); a beat thread may be stuck in a store call on a
        frozen store host, so it is not waited for (a daemon: it dies with the process)."""
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join(timeout=2 * self.interval_s + 1)
