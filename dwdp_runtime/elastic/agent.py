"""MembershipAgent: one rank's thread that proposes and follows an elastic group's membership epochs, admits
replacements, and moves the group's store when its host is lost. Off the forward path.

Pipeline (the agent's thread does all its store I/O; the serving loop only calls ``poll``):
  1. follow: read ``membership/<n+1>`` while it exists and adopt each epoch in order (``_adopt``); a rank that
     missed a loss or a join learns it from the store;
  2. losses: ``PeerMonitor(elastic=True)`` names silent peers (``lost_ranks``); the agent proposes
     ``next_membership(latest, lost, joins)`` by ``store_claim("membership/<n+1>")`` — a compare-and-set on an
     absent key, so exactly one proposal per epoch wins and every rank reads the same winner; a survivor whose view
     lost more proposes again at n+2, so the group converges on the union of what its members saw;
  3. joins: a replacement of a lost rank (a new process for the same rank: ``entry.open_group`` found the running
     group) loads its share, exports it, publishes its ``MemberRecord`` and a ``JoinRequest`` (``request_join``),
     and beats; a member admits it in its next proposal once its record and its beats carry the request's
     incarnation. Every member then imports the replacement's memory at ``poll`` (``DwdpManager.set_membership``
     with ``records``); the replacement serves once an epoch names it (``wait_admitted``);
  4. failover: when the monitor judges the store lost, ``on_store_lost`` starts ``_failover`` in a new thread:
     ``store_chain.promote_successor`` over the members but the lost host; the rendezvous switches to the promoted
     standby (``switch_to``), this rank re-registers there (its record, the latest membership), the monitor
     ``resume``s with the old host counted lost, and the agent's thread is replaced (the old one may stay blocked
     on the frozen store; its generation token makes it exit when it wakes);
  5. ``poll()`` (the serving loop, between forwards) returns the newest membership not yet applied, without store
     I/O. A membership that does not name this process (its rank run by its incarnation) raises ``Fenced``: a rank
     the others declared dead (a frozen one that woke up) must stop serving, never keep answering as a member. A
     store host that finds its peers silent, or its own store rounds stalled, first asks the others' standbys for a
     newer store generation: one exists only if the others failed over without it (it was frozen), and then it is
     ``Fenced`` too.

Invariants: every rank applies the same sequence of epochs (the store's winners); a candidate (a replacement
before admission) proposes nothing; the latch ``_fenced`` never clears.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ..membership import Fenced, Membership, epoch_key, next_membership
from ..monitor import PeerMonitor
from ..rendezvous import RendezvousError, StoreRendezvous
from .records import JoinRequest, MemberRecord, join_key, member_key
from .store_chain import Endpoint, StoreUnreachable, bounded, find_active, promote_successor, successors

log = logging.getLogger(__name__)

HEAD_KEY = "membership/head"
#: the failover's own store I/O on the promoted store (re-registering): it just answered, so this only bounds a
#: second fault during the failover
REREGISTER_TIMEOUT_S = 2.0


class JoinRefused(RendezvousError):
    """A replacement cannot join the running group (the reason names what differs); the group serves on."""


@dataclass(frozen=True)
class Failover:
    """One move of the group's store, as this rank made it."""

    generation: int
    lost_host: int
    new_host: int
    seconds: float          # from the monitor's verdict to serving the new store
    reason: str


def read_latest(rdzv: StoreRendezvous, start: int = 0) -> Membership | None:
    """The newest membership in the group's current store: from its ``head`` hint (or ``start``) forward while the
    next epoch exists; ``None`` when no epoch is stored at all."""
    raw_head = rdzv.store_get_verified_nowait(HEAD_KEY)
    n = max(start, int(raw_head)) if raw_head else start
    raw = rdzv.store_get_verified_nowait(epoch_key(n))
    if raw is None:
        return None
    latest = Membership.decode(raw)
    while (nxt := rdzv.store_get_verified_nowait(epoch_key(latest.epoch + 1))) is not None:
        latest = Membership.decode(nxt)
    return latest


class MembershipAgent:
    """Proposes and follows membership epochs for one rank (module docstring)."""

    def __init__(self, rendezvous: StoreRendezvous, monitor: PeerMonitor, *, incarnation: str, membership: Membership,
                 record: MemberRecord, standbys: Sequence[Endpoint] | None = None, candidate: bool = False,
                 records: dict[int, MemberRecord] | None = None, interval_s: float | None = None):
        if not monitor.elastic:
            raise ValueError("MembershipAgent needs PeerMonitor(elastic=True): a non-elastic monitor ends the group")
        self._rdzv, self._monitor = rendezvous, monitor
        self.interval_s = interval_s if interval_s is not None else monitor.interval_s
        self.rank, self.incarnation, self.record = rendezvous.rank, incarnation, record
        self.standbys = tuple(standbys) if standbys is not None else None
        self._latest = membership           # replaced, never mutated (read by poll)
        self._admitted = not candidate
        self._applied = membership.epoch if self._admitted else -1
        self._fenced: str | None = None
        self.records: dict[int, MemberRecord] = dict(records or {})  # the members' records, for set_membership
        self.records[self.rank] = record
        self.failovers: list[Failover] = []
        self._lock = threading.Lock()
        self._failover_running = False
        self._stop = threading.Event()
        self._token = 0
        self.detected_at: dict[int, float] = {}  # epoch → time.time() this rank learned it
        if self.standbys is not None:
            monitor.on_store_lost = self.on_store_lost

    def start(self) -> "MembershipAgent":
        self._start_loop()
        return self

    def _start_loop(self) -> None:
        self._token += 1
        threading.Thread(target=self._loop, args=(self._token,), name="dwdp-membership", daemon=True).start()

    @property
    def latest(self) -> Membership:
        return self._latest

    @property
    def admitted(self) -> bool:
        return self._admitted

    def poll(self) -> Membership | None:
        """The newest membership not yet returned (``None``: no change). No store I/O. Raises ``Fenced`` (before
        ``PeerLost``: a fenced rank's own monitor may also have judged the store it hosted lost, and the reason to
        report is that the group moved on without it)."""
        m = self._latest
        if self._fenced is None:
            self._monitor.check()  # a lost store without a failover is still fatal
        if self._fenced is not None or (self._admitted and not m.serves(self.rank, self.incarnation)):
            raise Fenced(self._fenced or f"rank {self.rank} was excluded from {self._rdzv.where} at membership epoch "
                                         f"{m.epoch} (members {sorted(m.alive)})")
        if not self._admitted or m.epoch == self._applied:
            return None
        self._applied = m.epoch
        return m

    # -- a replacement ------------------------------------------------------------------------------------
    def request_join(self) -> None:
        """Publish this replacement's record, then ask to join (module docstring, 3)."""
        self._rdzv.store_set_verified(member_key(self.rank), self.record.encode())
        self._rdzv.store_set_verified(join_key(self.rank), JoinRequest(self.incarnation).encode())

    def wait_admitted(self, timeout_s: float) -> Membership:
        """Block until an epoch names this replacement; ``JoinRefused`` at the deadline (the group serves on)."""
        deadline = time.monotonic() + timeout_s
        while not self._admitted:
            self._monitor.check()
            if time.monotonic() > deadline:
                raise JoinRefused(f"rank {self.rank} (incarnation {self.incarnation}) was not admitted into "
                                  f"{self._rdzv.where} within {timeout_s:g} s (members {sorted(self._latest.alive)} "
                                  f"at epoch {self._latest.epoch}): no member took its join request")
            time.sleep(min(self.interval_s, 0.1))
        m = self._latest
        if not m.serves(self.rank, self.incarnation):  # admitted, then excluded again before this read
            raise Fenced(self._fenced or f"rank {self.rank} was excluded again at membership epoch {m.epoch}")
        self._applied = m.epoch  # the caller applies it (set_membership); poll() returns only newer ones
        return m

    # -- the agent's thread: all store I/O ----------------------------------------------------------------
    def _adopt(self, m: Membership) -> None:
        if m.epoch <= self._latest.epoch:
            return
        prev = self._latest
        came = {r for r, inc in m.members if prev.incarnations.get(r) != inc and r != self.rank}
        for r in sorted(came):  # the new members' records, before poll() can hand the epoch out
            raw = self._rdzv.store_get_verified_nowait(member_key(r))
            if raw is not None:
                rec = MemberRecord.decode(raw)
                if rec.incarnation == m.incarnations[r]:
                    self.records[r] = rec
        for r in came:
            self._monitor.readmit(r)
        # _latest first: a reader that sees _admitted (wait_admitted) or _fenced must find the epoch that set it
        self._latest = m
        if not self._admitted and m.serves(self.rank, self.incarnation):
            self._admitted = True
            log.warning("%s: rank %d joined at membership epoch %d, members %s", self._rdzv.where, self.rank,
                        m.epoch, sorted(m.alive))
        elif self._admitted and not m.serves(self.rank, self.incarnation):
            self._fenced = (f"rank {self.rank} was excluded from {self._rdzv.where} at membership epoch {m.epoch} "
                            f"(members {sorted(m.alive)}): the others declared it dead; it must stop serving")
        self._rdzv.members = m.alive  # the store's host waits only for these at close
        self.detected_at[m.epoch] = time.time()
        if self._admitted:
            self._rdzv.store_set_verified(HEAD_KEY, str(m.epoch).encode())
        log.warning("%s: membership epoch %d, members %s", self._rdzv.where, m.epoch, sorted(m.alive))

    def step(self, token: int | None = None) -> None:
        """One round: follow the store's next epochs, then propose one if a member was lost or a replacement waits.
        ``token``: the loop's generation; a round of a loop a failover replaced (it was blocked on the lost store)
        stops at its next store answer instead of acting on what it read there."""
        def current() -> bool:
            return token is None or token == self._token

        while (raw := self._rdzv.store_get_verified_nowait(epoch_key(self._latest.epoch + 1))) is not None:
            if not current():
                return
            self._adopt(Membership.decode(raw))
        if not self._admitted or self._fenced is not None or not current():
            return
        lost = self._monitor.lost_ranks & self._latest.alive
        if lost and self._rdzv.host_rank == self.rank and self._superseded():
            return
        proposal = next_membership(self._latest, lost, self._ready_joins())
        if proposal is not None and current():
            won = Membership.decode(self._rdzv.store_claim(epoch_key(proposal.epoch), proposal.encode()))
            if current():
                self._adopt(won)

    def _ready_joins(self) -> dict[int, str]:
        """Replacements ready to be admitted: a join request whose incarnation the rank's record and beats carry."""
        joins = {}
        for r in range(self._rdzv.world_size):
            if r in self._latest.alive:
                continue
            raw = self._rdzv.store_get_verified_nowait(join_key(r))
            if raw is None:
                continue
            inc = JoinRequest.decode(raw).incarnation
            rec = self._rdzv.store_get_verified_nowait(member_key(r))
            beat = self._monitor.moving(r)  # a request left by a replacement that died since never has a moving beat
            if rec is not None and MemberRecord.decode(rec).incarnation == inc and beat is not None \
                    and beat.startswith(f"{inc}:".encode()):
                joins[r] = inc
        return joins

    def _superseded(self) -> bool:
        """This rank hosts the store and sees members silent: did they fail over without it (module docstring, 5)?"""
        if self.standbys is None:
            return False
        # every other rank's standby, not only the silent ones': the store may have moved to a rank whose last beat
        # here came late (a thread of it blocked on this store while this process was frozen, written on waking)
        others = [e for e in self.standbys if e.rank != self.rank]
        newer = find_active(others, self._rdzv.keys, newer_than=self._rdzv.generation)
        if newer is None:
            return False
        self._fenced = (f"rank {self.rank} hosted the store of {self._rdzv.where} but the group moved to "
                        f"{newer.endpoint.describe()} (generation {newer.active.generation}) without it: it was "
                        f"frozen or cut off; it must stop serving")
        return True

    def _loop(self, token: int) -> None:
        while not self._stop.is_set() and token == self._token:
            try:
                self.step(token)
            except Exception as exc:  # noqa: BLE001 - the store failed: the monitor judges it (failover or fatal)
                if token == self._token:
                    log.warning("membership round failed: %s", exc)
            self._stop.wait(self.interval_s)

    # -- failover (module docstring, 4) -----------------------------------------------------------------------
    def on_store_lost(self, why: str) -> bool:
        """From the monitor's watch thread: start the failover (True), or decline (False: the loss is fatal). On
        the store's own host the store cannot be lost while this process runs: its rounds stalled because the
        process itself was frozen or starved, so the question is whether the others moved on without it
        (``_host_stalled``)."""
        if self.standbys is None or self._fenced is not None:
            return False
        with self._lock:
            if self._failover_running:
                return True
            self._failover_running = True
        host = self._rdzv.host_rank == self.rank
        threading.Thread(target=self._host_stalled if host else self._failover, args=(why,),
                         name="dwdp-store-failover", daemon=True).start()
        return True

    def _host_stalled(self, why: str) -> None:
        """This rank hosts the store and its own rounds stalled past the bound. If the group moved to a standby
        store without it (a newer generation answers there), it is fenced: ``poll`` raises ``Fenced`` and the
        monitor stays parked (its records are of a store nobody uses). Otherwise the loss is fatal, as in a static
        group. Found by the SIGSTOP test of tests/runtime/test_elastic_rejoin.py: woken on a loaded machine, the
        host's own first round took longer than the bound, and the rank reported a lost store instead of being
        fenced."""
        try:
            superseded = self._superseded()
        except Exception as exc:  # noqa: BLE001 - the search itself failed: nothing says the group moved on
            log.warning("the search for a newer store failed: %s", exc)
            superseded = False
        finally:
            with self._lock:
                self._failover_running = False
        if superseded:
            log.warning("%s", self._fenced)
            return
        self._monitor.fail(why)

    def _failover(self, why: str) -> None:
        t0 = time.monotonic()
        lost_host, generation = self._rdzv.host_rank, self._rdzv.generation + 1
        try:
            found = promote_successor(successors(self.standbys, lost_host=lost_host, members=self._latest.alive),
                                      self._rdzv.keys, generation=generation)
            self._token += 1  # the old thread may be blocked on the lost store: it exits when it wakes
            self._rdzv.switch_to(found.store, generation=found.active.generation, host_rank=found.active.host_rank,
                                 where=found.endpoint.describe())
            bounded(self._reregister, REREGISTER_TIMEOUT_S, found.endpoint.describe())
        except (StoreUnreachable, TimeoutError, RendezvousError, ValueError) as exc:
            self._monitor.fail(f"{why}; the failover to a standby store failed: {exc}")
            return
        finally:
            with self._lock:
                self._failover_running = False
        done = Failover(found.active.generation, lost_host, found.active.host_rank, time.monotonic() - t0, why)
        self.failovers.append(done)
        log.warning("%s: the store moved to %s after losing rank %d's (%.2f s)", self._rdzv.where,
                    found.endpoint.describe(), lost_host, done.seconds)
        self._monitor.resume(lost_host)
        self._start_loop()

    def _reregister(self) -> None:
        """On the promoted store (it starts empty): this rank's record, then the latest epoch it knows (a member; the
        first claim of an epoch wins, and a survivor that knew less catches up from there) or, a replacement not yet
        admitted, its join request again."""
        self._rdzv.store_set_verified(member_key(self.rank), self.record.encode())
        latest = self._latest
        if not self._admitted:
            self._rdzv.store_set_verified(join_key(self.rank), JoinRequest(self.incarnation).encode())
            return
        won = Membership.decode(self._rdzv.store_claim(epoch_key(latest.epoch), latest.encode()))
        if won != latest:
            log.warning("the promoted store holds epoch %d as %s, this rank as %s", latest.epoch, won, latest)
        self._rdzv.store_set_verified(HEAD_KEY, str(latest.epoch).encode())

    def stop(self) -> None:
        self._stop.set()
