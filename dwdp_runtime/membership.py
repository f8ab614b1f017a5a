"""Membership epochs of an elastic DWDP group (issue #30): who serves, agreed through the store, off the forward path.

A group with expert replicas (``expert_replicas`` r ≥ 2, ``layout.holder_layout``) survives the loss of a rank:
the survivors agree on a new *membership* — an epoch number and the members, each a rank with the
*incarnation* (a per-process id) that serves it — and re-plan their copies so every expert is pulled from a
surviving holder (``DwdpManager.set_membership``). A replacement process of a lost rank *joins* at a later epoch
(``elastic.agent``): the same rank, a new incarnation.

This module is the pure part: the ``Membership`` value, ``next_membership`` (what a member proposes), and
``group_survives`` (whether a loss is survivable at all). The thread that proposes and follows epochs through the
store is ``elastic.agent.MembershipAgent``.

Invariants: epochs are consecutive integers from 0 (the formed group); each epoch differs from the one before by
losses (ranks dropped) and admitted joins (ranks added with their new incarnation), never by a member changing its
incarnation in place; every rank applies the same sequence (the store's winners), so any two ranks at the same
epoch pull every expert from the same ``layout.surviving_owner``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from .config import DwdpConfig
from .contract import OnUncovered
from .layout import coverage
from .monitor import PeerLost


class Fenced(PeerLost):
    """This rank was excluded from the group's membership by the others (they re-planned without it)."""


@dataclass(frozen=True)
class Membership:
    epoch: int
    members: tuple[tuple[int, str], ...]   # (rank, incarnation), ascending by rank

    @classmethod
    def of(cls, epoch: int, members: Mapping[int, str]) -> "Membership":
        return cls(epoch, tuple(sorted((int(r), str(i)) for r, i in members.items())))

    @property
    def alive(self) -> frozenset[int]:
        return frozenset(r for r, _ in self.members)

    @property
    def incarnations(self) -> dict[int, str]:
        return dict(self.members)

    def serves(self, rank: int, incarnation: str) -> bool:
        """Whether this process (``rank`` run by ``incarnation``) is a member."""
        return self.incarnations.get(rank) == incarnation

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "members": {str(r): i for r, i in self.members}}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Membership":
        d = json.loads(raw)
        return cls.of(int(d["epoch"]), {int(r): i for r, i in d["members"].items()})


def next_membership(current: Membership, lost: Iterable[int], joins: Mapping[int, str] | None = None
                    ) -> Membership | None:
    """The proposal after ``current``: without the ranks seen ``lost``, with ``joins`` (rank → incarnation of a
    replacement ready to serve) for ranks that are not members then; ``None`` when nothing changes (pure)."""
    members = {r: i for r, i in current.members if r not in set(lost)}
    for rank, incarnation in (joins or {}).items():
        if rank not in members:
            members[rank] = incarnation
    return None if members == current.incarnations else Membership.of(current.epoch + 1, members)


def group_survives(config: DwdpConfig, lost_ranks: Iterable[int]) -> bool:
    """Whether a group can keep serving without ``lost_ranks``: elastic (``config.elastic``), someone left, and
    every expert still on a surviving holder (``layout.coverage`` ≥ 1) — or, with ``on_uncovered=reload``, read
    back from the checkpoint by the survivors (``DwdpManager.reload_uncovered``). Otherwise: a group restart."""
    lost = set(lost_ranks)
    return (config.elastic and len(lost) < config.dwdp_size
            and (config.on_uncovered == OnUncovered.RELOAD or coverage(config.holders(), lost) >= 1))


def epoch_key(epoch: int) -> str:
    return f"membership/{epoch}"
