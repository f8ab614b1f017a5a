"""The store's own host whose store rounds stall (its process was frozen or starved) asks the others' standbys
whether the group moved on: fenced if a newer store generation answers there, a fatal store loss otherwise.

Real TCPStores (the primary hosted by this process, two standbys); the monitor is never started, so its rounds
never complete, which is what a frozen or starved host sees of its own store. The race this pins down was seen
on CI in test_elastic_rejoin.py's SIGSTOP test: the woken host's store verdict fired before its agent looked for a
newer store, and it reported a lost store instead of being fenced."""

from __future__ import annotations

import time

import pytest

from dwdp_runtime.elastic.agent import MembershipAgent
from dwdp_runtime.elastic.records import MemberRecord
from dwdp_runtime.elastic.store_chain import Endpoint, StandbyStore, promote_successor
from dwdp_runtime.membership import Fenced, Membership
from dwdp_runtime.monitor import PeerLost, PeerMonitor
from dwdp_runtime.ports import free_port_block
from dwdp_runtime.rendezvous import StoreRendezvous

DEAD_AFTER_S = 0.5
#: the verdict fires after DEAD_AFTER_S; the search for a newer store is bounded by a few probe timeouts
VERDICT_DEADLINE_S = 30.0


@pytest.fixture
def host_group():
    base = free_port_block(3)
    standbys = [Endpoint("127.0.0.1", base + 1 + r, r) for r in range(2)]
    servers = [StandbyStore(e.port) for e in standbys]
    rdzv = StoreRendezvous(host="127.0.0.1", port=base, rank=0, world_size=2, job="stall", token="t", timeout_s=10)
    monitor = PeerMonitor(rdzv, interval_s=0.1, dead_after_s=DEAD_AFTER_S, elastic=True)
    agent = MembershipAgent(rdzv, monitor, incarnation="r0-a", membership=Membership.of(0, {0: "r0-a", 1: "r1-a"}),
                            record=MemberRecord(0, "r0-a"), standbys=standbys)
    yield rdzv, standbys, agent
    agent.stop()
    monitor.stop()
    rdzv.close(linger_s=0.0)
    for s in servers:
        s.close()


def _poll_until_it_raises(agent: MembershipAgent) -> PeerLost:
    deadline = time.monotonic() + VERDICT_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            agent.poll()
        except PeerLost as exc:
            return exc
        time.sleep(0.05)
    raise AssertionError(f"poll() raised nothing within {VERDICT_DEADLINE_S:g} s of a stalled store")


def test_a_stalled_host_whose_group_moved_to_a_standby_is_fenced(host_group):
    rdzv, standbys, agent = host_group
    promote_successor([standbys[1]], rdzv.keys, generation=1)   # the others failed over while this host was frozen
    exc = _poll_until_it_raises(agent)
    assert isinstance(exc, Fenced), exc
    assert str(exc).startswith("rank 0 hosted the store") and "rank 1's standby" in str(exc), exc
    assert "generation 1" in str(exc)
    with pytest.raises(Fenced):   # the latch never clears
        agent.poll()


def test_a_stalled_host_with_no_newer_store_anywhere_is_a_fatal_store_loss(host_group):
    _, _, agent = host_group
    exc = _poll_until_it_raises(agent)
    assert not isinstance(exc, Fenced), exc
    assert "has not answered" in str(exc), exc
