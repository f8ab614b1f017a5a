"""How a rank enters its group: form it with the others, or join it as a replacement while it runs.

``open_group`` (before any weight is read):
  * a static group (not elastic): the primary store, as always (rank 0 hosts it) — formation;
  * an elastic group: first this rank's standby store goes up (``store_chain.StandbyStore``: it must answer from
    the moment a failover could need it), then every endpoint of the chain is asked for a formed store
    (``store_chain.find_active``). None: formation at the primary. One: the group runs — this process replaces a
    lost rank and *joins* (``JoinPoint``), through that store, whichever rank hosts it now. Before the caller
    loads anything, the join is checked: the group's fingerprint must equal this rank's (``JoinRefused`` names the
    parts that differ: checkpoint, layout, weights …), and the rank must be out of the running membership (its old
    process declared lost; waited for, bounded by ``EXCLUSION_WAIT_S``).

``complete_formation`` (after ``DwdpManager.setup`` on every rank): each rank publishes its ``MemberRecord``, the
records are gathered into epoch 0's membership (every rank with its incarnation), epoch 0 and the group's
fingerprint are claimed, and rank 0 marks the primary formed (``store_chain.mark_formed``): from then on a new
process of this group attempt joins instead of forming.

Invariant: a process forms only where no formed store of its group attempt answers; a joiner never takes part in
a formation's collectives (allgather, barriers), and a former never waits for a joiner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..membership import Membership, epoch_key
from ..rendezvous import GroupKeys, RendezvousError, StoreRendezvous
from .agent import HEAD_KEY, JoinRefused, read_latest
from .records import FINGERPRINT_KEY, GroupFingerprint, MemberRecord, member_key
from .store_chain import ActiveStore, Endpoint, StandbyStore, find_active, mark_formed, standby_endpoints

log = logging.getLogger(__name__)

#: how long a replacement waits for the group to declare its predecessor lost: the detection bound (3 s of silence +
#: two 0.5 s beats, runtime monitor) several times over, for a loaded node; longer means another process serves it
EXCLUSION_WAIT_S = 30.0
#: a replacement's wait for its standby port, held by its predecessor until that process has exited
STANDBY_PORT_WAIT_S = 10.0
#: how often a replacement re-checks those two waits: both end on events of seconds (a process exiting, a loss
#: declared after 3 s of silence), so a finer poll would only load the store
JOIN_POLL_S = 0.2


@dataclass(frozen=True)
class JoinPoint:
    """The running group a replacement joins: its membership then (without this rank) and its members' records."""

    membership: Membership
    records: dict[int, MemberRecord]


@dataclass
class GroupEntry:
    rendezvous: StoreRendezvous
    standbys: tuple[Endpoint, ...] | None = None   # None: a static group (no failover)
    standby: StandbyStore | None = None            # this rank's standby store (elastic)
    join: JoinPoint | None = None                  # None: this rank forms the group

    def close(self) -> None:
        if self.standby is not None:
            self.standby.close()


def open_group(*, host: str, port: int, rank: int, world_size: int, job: str, group: int, attempt: int, token: str,
               timeout_s: float, elastic: bool, fingerprint: GroupFingerprint, incarnation: str,
               pod_addr_template: str | None = None, gpus_per_pod: int = 1,
               exclusion_wait_s: float = EXCLUSION_WAIT_S) -> GroupEntry:
    """Form or join (module docstring). Raises ``JoinRefused`` (a replacement that must not join) or
    ``RendezvousError`` (no store)."""
    if not elastic:
        return GroupEntry(StoreRendezvous(host=host, port=port, rank=rank, world_size=world_size, job=job,
                                          group=group, attempt=attempt, token=token, timeout_s=timeout_s))
    standbys = standby_endpoints(world_size=world_size, store_host=host, store_port=port,
                                 pod_addr_template=pod_addr_template, gpus_per_pod=gpus_per_pod)
    keys = GroupKeys(job=job, group=group, attempt=attempt, token=token)
    found = find_active([Endpoint(host, port), *(e for e in standbys if e.rank != rank)], keys)
    if found is None:  # formation: the standby answers from the start (a failover may need it any time after)
        standby = StandbyStore(standbys[rank].port)
        try:
            rdzv = StoreRendezvous(host=host, port=port, rank=rank, world_size=world_size, job=job, group=group,
                                   attempt=attempt, token=token, timeout_s=timeout_s)
        except BaseException:
            standby.close()
            raise
        return GroupEntry(rdzv, standbys, standby)
    rdzv = StoreRendezvous(host=host, port=port, rank=rank, world_size=world_size, job=job, group=group,
                           attempt=attempt, token=token, timeout_s=timeout_s, store=found.store,
                           generation=found.active.generation, host_rank=found.active.host_rank)
    log.warning("%s runs (%s): rank %d joins it as a replacement", rdzv.where, found.endpoint.describe(), rank)
    join = _join_point(rdzv, fingerprint, incarnation, exclusion_wait_s)
    # a replacement is no failover candidate before it is admitted: its standby starts once its predecessor is out
    # (on a shared host that process may still be exiting and hold the port for a moment)
    return GroupEntry(rdzv, standbys, _standby_when_free(standbys[rank].port, rank, STANDBY_PORT_WAIT_S), join)


def _standby_when_free(port: int, rank: int, wait_s: float) -> StandbyStore:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return StandbyStore(port)
        except RendezvousError as exc:
            if time.monotonic() > deadline:
                raise JoinRefused(f"rank {rank}'s standby store port {port} is still in use on this host after "
                                  f"{wait_s:g} s: another process (its predecessor?) holds it; this one is refused"
                                  ) from exc
            time.sleep(JOIN_POLL_S)


def _join_point(rdzv: StoreRendezvous, fingerprint: GroupFingerprint, incarnation: str, wait_s: float) -> JoinPoint:
    raw = rdzv.store_get_verified_nowait(FINGERPRINT_KEY)
    if raw is not None:
        theirs = GroupFingerprint.decode(raw)
        differ = fingerprint.differences(theirs)
        if differ:
            raise JoinRefused(f"replacement rank {rdzv.rank} differs from the running {rdzv.where} in "
                              f"{', '.join(differ)}: it loaded another checkpoint or layout than the group serves; "
                              f"it is refused and the group keeps serving (give it the group's model and settings)")
    deadline = time.monotonic() + wait_s
    while True:
        latest = read_latest(rdzv)
        if latest is None:
            raise RendezvousError(f"{rdzv.where} is marked formed but holds no membership epoch")
        if rdzv.rank not in latest.alive:
            break
        if time.monotonic() > deadline:
            raise JoinRefused(f"rank {rdzv.rank} is still a member of the running {rdzv.where} (incarnation "
                              f"{latest.incarnations[rdzv.rank]}, epoch {latest.epoch}) after {wait_s:g} s: another "
                              f"process serves it; this one ({incarnation}) is refused")
        time.sleep(JOIN_POLL_S)
    records = {}
    for r in sorted(latest.alive):
        rec = rdzv.store_get_verified_nowait(member_key(r))
        if rec is None or MemberRecord.decode(rec).incarnation != latest.incarnations[r]:
            raise RendezvousError(f"{rdzv.where}: no record of member {r} (incarnation {latest.incarnations[r]})")
        records[r] = MemberRecord.decode(rec)
    return JoinPoint(latest, records)


def claim_fingerprint(rdzv: StoreRendezvous, fingerprint: GroupFingerprint) -> None:
    """At formation, before loading: the first claim is the group's; a rank that differs fails now, naming how."""
    won = GroupFingerprint.decode(rdzv.store_claim(FINGERPRINT_KEY, fingerprint.encode()))
    differ = fingerprint.differences(won)
    if differ:
        raise RendezvousError(f"rank {rdzv.rank} of {rdzv.where} differs from the group's other ranks in "
                              f"{', '.join(differ)}: every rank must load the same checkpoint with the same layout")


def complete_formation(rdzv: StoreRendezvous, record: MemberRecord) -> tuple[Membership, dict[int, MemberRecord]]:
    """After every rank's setup: epoch 0 from the gathered records, claimed; rank 0 marks the store formed."""
    records = {r: MemberRecord.decode(raw) for r, raw in enumerate(rdzv.allgather("members", record.encode()))}
    full = Membership.of(0, {r: rec.incarnation for r, rec in records.items()})
    rdzv.store_claim(epoch_key(0), full.encode())
    for r, rec in records.items():
        if r == rdzv.rank:
            rdzv.store_set_verified(member_key(r), rec.encode())
    if rdzv.rank == 0:
        rdzv.store_set_verified(HEAD_KEY, b"0")
        mark_formed(rdzv.store, rdzv.keys, ActiveStore(0, 0))
    rdzv.barrier("formed")
    return full, records
