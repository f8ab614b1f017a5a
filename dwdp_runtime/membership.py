"""Membership epochs of an elastic DWDP group (issue #30): who serves, agreed through the store, off the forward path.

A group with expert replicas (``expert_replicas`` r ≥ 2, ``layout.holder_layout``) survives the loss of a rank:
the survivors agree on a new *membership* ``(epoch, alive)`` and re-plan their copies so every expert is
pulled from a surviving holder (``DwdpManager.set_membership``).

Pipeline:
  1. ``PeerMonitor(elastic=True)`` names silent peers (``lost_ranks``) within its bound
     (``dead_after_s`` + 2 × ``interval_s``); a lost store stays fatal (``PeerMonitor.lost``).
  2. The agent's thread — the only one here that talks to the store — proposes epoch n+1 =
     ``next_membership(current, lost)`` by ``store_claim("membership/<n+1>")``: a compare-and-set on an
     absent key, so exactly one proposal per epoch wins, and every rank reads the same winner.
     A survivor that finds a winner keeping a rank it saw die proposes again at n+2 (epochs only shrink
     the set), so the group converges on the union of what its members saw.
  3. It also reads ``membership/<n+1>`` every interval: a rank that missed a loss learns it from the store.
  4. ``poll()`` (the serving loop, between forwards) returns the newest membership not yet applied,
     without any store I/O; a membership that excludes this rank raises ``Fenced``: a rank the others
     declared dead (a frozen one that woke up) must stop serving, never keep answering as a member.

Invariants: epochs are consecutive integers from 0 (the full group); each epoch's ``alive`` is a
subset of the previous one's; every rank applies the same sequence (the store's winners), so any
two ranks at the same epoch pull every expert from the same ``layout.surviving_owner``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from .config import DwdpConfig
from .contract import OnUncovered
from .layout import coverage
from .monitor import PeerLost, PeerMonitor
from .rendezvous import StoreRendezvous

log = logging.getLogger(__name__)


class Fenced(PeerLost):
    """This rank was excluded from the group's membership by the others (they re-planned without it)."""


@dataclass(frozen=True)
class Membership:
    epoch: int
    alive: frozenset[int]

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "alive": sorted(self.alive)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Membership":
        d = json.loads(raw)
        return cls(int(d["epoch"]), frozenset(int(r) for r in d["alive"]))

    @classmethod
    def full(cls, world_size: int) -> "Membership":
        return cls(0, frozenset(range(world_size)))


def next_membership(current: Membership, lost: Iterable[int]) -> Membership | None:
    """The proposal after ``current`` given the ranks seen lost; ``None`` when nothing changes (pure)."""
    alive = current.alive - frozenset(lost)
    return None if alive == current.alive else Membership(current.epoch + 1, alive)


def group_survives(config: DwdpConfig, lost_ranks: Iterable[int]) -> bool:
    """Whether a group can keep serving without ``lost_ranks``: elastic (``config.elastic``), someone left, and
    every expert still on a surviving holder (``layout.coverage`` ≥ 1) — or, with ``on_uncovered=reload``, read
    back from the checkpoint by the survivors (``DwdpManager.reload_uncovered``). Otherwise: a group restart."""
    lost = set(lost_ranks)
    return (config.elastic and len(lost) < config.dwdp_size
            and (config.on_uncovered == OnUncovered.RELOAD or coverage(config.holders(), lost) >= 1))


def epoch_key(epoch: int) -> str:
    return f"membership/{epoch}"


class MembershipAgent:
    """Proposes and follows membership epochs for one rank (module docstring)."""

    def __init__(self, rendezvous: StoreRendezvous, monitor: PeerMonitor, *, interval_s: float | None = None):
        if not monitor.elastic:
            raise ValueError("MembershipAgent needs PeerMonitor(elastic=True): a non-elastic monitor ends the group")
        self._rdzv, self._monitor = rendezvous, monitor
        self.interval_s = interval_s if interval_s is not None else monitor.interval_s
        self.rank = rendezvous.rank
        self._latest = Membership.full(rendezvous.world_size)   # replaced, never mutated (read by poll)
        self._applied = self._latest.epoch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dwdp-membership", daemon=True)
        self.detected_at: dict[int, float] = {}  # epoch → time.time() this rank learned it

    def start(self) -> "MembershipAgent":
        self._thread.start()
        return self

    @property
    def latest(self) -> Membership:
        return self._latest

    def poll(self) -> Membership | None:
        """The newest membership not yet returned (``None``: no change). No store I/O. Raises ``Fenced``."""
        self._monitor.check()  # a lost store is still fatal
        m = self._latest
        if self.rank not in m.alive:
            raise Fenced(f"rank {self.rank} was excluded from {self._rdzv.where} at membership epoch {m.epoch} "
                         f"(members {sorted(m.alive)}): the others declared it dead; it must stop serving")
        if m.epoch == self._applied:
            return None
        self._applied = m.epoch
        return m

    # -- the agent's thread: all store I/O ---------------------------------------------------------------
    def _adopt(self, m: Membership) -> None:
        if m.epoch > self._latest.epoch:
            self._latest = m
            self._rdzv.members = m.alive & self._rdzv.members  # rank 0 waits only for these at close
            self.detected_at[m.epoch] = time.time()
            log.warning("%s: membership epoch %d, members %s", self._rdzv.where, m.epoch, sorted(m.alive))

    def step(self) -> None:
        """One round: follow the store's next epochs, then propose one if a member was seen lost."""
        while True:  # catch up with epochs other ranks already agreed on
            raw = self._rdzv.store_get_verified_nowait(epoch_key(self._latest.epoch + 1))
            if raw is None:
                break
            self._adopt(Membership.decode(raw))
        proposal = next_membership(self._latest, self._monitor.lost_ranks)
        if proposal is not None:
            won = Membership.decode(self._rdzv.store_claim(epoch_key(proposal.epoch), proposal.encode()))
            self._adopt(won)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the store is gone: the monitor says so (fatal)
                log.warning("membership agent stopped: %s", exc)
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=min(self.interval_s, 1.0) + 0.5)
