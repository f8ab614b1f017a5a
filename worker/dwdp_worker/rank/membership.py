"""The rank side of an elastic group (issue #30): enter it, join it as a replacement, follow its epochs.

Called by ``process`` (the rank process) only; every function runs on the rank's main thread except ``report_lost``
(also the peer monitor's thread). What crosses to the front: ``MembershipChanged`` (an epoch applied: who joined,
whose memory could not be read), ``ExpertsReloaded``, ``StoreMoved`` (once per failover), ``PeerLost`` (the group
cannot serve on), phase ``joining``. The runtime's side: ``dwdp_runtime.elastic`` (docs/RUNTIME.md).
"""

from __future__ import annotations

import time

from dwdp_runtime.holders_reload import ReloadRefused

from . import protocol as p
from . import timeouts


def group_fingerprint(config, spec: p.RankSpec, checkpoint: str):
    """What every rank of a group must serve alike (a replacement that differs is refused by name)."""
    from dwdp_runtime.elastic.records import GroupFingerprint

    return GroupFingerprint.of(layout=config.to_dict(), checkpoint=checkpoint, dtype=spec.dtype or "checkpoint",
                               backend=spec.backend)


def membership_agent(engine, rdzv, monitor, entry, incarnation: str):
    """The elastic group's agent: at formation, epoch 0 is gathered first (every rank names its process)."""
    from dwdp_runtime.elastic.agent import MembershipAgent
    from dwdp_runtime.elastic.entry import complete_formation

    record = engine.manager.member_record()
    if entry.join is None:
        membership, records = complete_formation(rdzv, record)
        engine.manager.name_members(membership)
        return MembershipAgent(rdzv, monitor, incarnation=incarnation, membership=membership, record=record,
                               standbys=entry.standbys, records=records)
    return MembershipAgent(rdzv, monitor, incarnation=incarnation, membership=entry.join.membership, record=record,
                           standbys=entry.standbys, candidate=True, records=entry.join.records)


def join(engine, link, agent) -> None:
    """A replacement, loaded and warm: ask to join, wait for the epoch that names it, apply it (issue #30)."""
    link.send(p.PhaseChanged(p.RankPhase.JOINING))
    t0 = time.perf_counter()
    agent.request_join()
    m = agent.wait_admitted(timeouts.JOIN_ADMISSION_S)
    t1 = time.perf_counter()
    unreadable = engine.manager.set_membership(m, agent.records)
    link.send(p.LoadProgress("joined", f"admitted at membership epoch {m.epoch} (members {sorted(m.alive)}) "
                                       f"{t1 - t0:.2f} s after asking"))
    link.send(p.MembershipChanged(m.epoch, tuple(sorted(m.alive)), time.perf_counter() - t1, joined=(agent.rank,),
                                  unreadable=tuple(sorted(unreadable))))


def peer_timing(spec: p.RankSpec, elastic: bool) -> tuple[float, float]:
    """(heartbeat interval, silence bound): an elastic group's shorter defaults unless the spec set its own."""
    if not elastic:
        return spec.peer_interval_s, spec.peer_dead_after_s
    interval = (timeouts.ELASTIC_PEER_HEARTBEAT_S if spec.peer_interval_s == timeouts.PEER_HEARTBEAT_S
                else spec.peer_interval_s)
    dead = (timeouts.ELASTIC_PEER_DEAD_AFTER_S if spec.peer_dead_after_s == timeouts.PEER_DEAD_AFTER_S
            else spec.peer_dead_after_s)
    return interval, dead


def apply_membership(engine, link, agent) -> None:
    """Between forwards: a new membership epoch → re-plan the copies over surviving holders, tell the front.
    With on_uncovered=reload the experts no survivor holds are read from the checkpoint first (``ExpertsReloaded``);
    ``ReloadRefused`` is reported as ``PeerLost`` (the front fails the group). ``Fenced`` (the others excluded
    this rank) and ``NoSurvivingHolder`` (an expert lost every copy)
    propagate: the rank exits non-zero with the reason."""
    report_failovers(link, agent)
    m = agent.poll()
    if m is None:
        return
    t0 = time.perf_counter()
    reloads = len(engine.manager.reloads)
    before = dict(engine.manager.incarnations)
    try:
        unreadable = engine.manager.set_membership(m, agent.records)
    except ReloadRefused as exc:  # the group cannot serve on: the front fails it at once (a group restart)
        report_lost(link, f"membership epoch {m.epoch}: {exc}")
        raise
    for rep in engine.manager.reloads[reloads:]:
        link.send(p.ExpertsReloaded(m.epoch, rep.experts, rep.bytes_read, rep.allocated_bytes, rep.seconds))
    joined = tuple(sorted(r for r, inc in m.members if before.get(r) != inc and r != agent.rank))
    link.send(p.MembershipChanged(m.epoch, tuple(sorted(m.alive)), time.perf_counter() - t0, joined=joined,
                                  unreadable=tuple(sorted(unreadable))))


def report_failovers(link, agent) -> None:
    """Each store move this rank made, once (``StoreMoved``)."""
    for f in agent.failovers[link.failovers_reported:]:
        link.send(p.StoreMoved(f.generation, f.lost_host, f.new_host, f.seconds))
    link.failovers_reported = len(agent.failovers)


def report_lost(link, why: str) -> None:
    try:
        link.send(p.PeerLost(why))
    except (OSError, ValueError):
        pass
