"""Membership epochs over a real TCPStore: one winner per epoch, convergence on the union of losses, fencing."""

from __future__ import annotations

import pytest

from dwdp_runtime.membership import Membership, epoch_key, next_membership
from dwdp_runtime.rendezvous import RendezvousError, StoreRendezvous
from tests.runtime.group import free_port


def _m(epoch, members):
    return Membership.of(epoch, {r: f"p{r}" if isinstance(members, set) else members[r] for r in members})


def test_next_membership_drops_losses_admits_joins_and_counts_epochs():
    full = _m(0, {0, 1, 2, 3})
    assert full.alive == {0, 1, 2, 3} and full.serves(1, "p1") and not full.serves(1, "q1")
    assert next_membership(full, ()) is None
    one = next_membership(full, {1})
    assert one == _m(1, {0, 2, 3})
    assert next_membership(one, {1}) is None                  # already out: no new epoch
    assert next_membership(one, {1, 3}) == _m(2, {0, 2})
    # a replacement of rank 1 (another incarnation) joins; the monitor still counts rank 1 lost until readmitted
    back = next_membership(one, {1}, {1: "q1"})
    assert back == Membership.of(2, {0: "p0", 1: "q1", 2: "p2", 3: "p3"})
    assert next_membership(back, (), {1: "z1"}) is None       # a member is never replaced in place
    assert next_membership(one, {3}, {1: "q1"}) == Membership.of(2, {0: "p0", 1: "q1", 2: "p2"})
    assert Membership.decode(back.encode()) == back


def test_one_claim_wins_per_epoch_and_a_forged_entry_is_refused():
    port = free_port()
    host = StoreRendezvous(host="127.0.0.1", port=port, rank=0, world_size=2, job="m", token="t", timeout_s=10)
    peer = StoreRendezvous(host="127.0.0.1", port=port, rank=1, world_size=2, job="m", token="t", timeout_s=10)
    try:
        a = _m(1, {0, 2, 3})
        b = _m(1, {0, 2})
        assert Membership.decode(host.store_claim(epoch_key(1), a.encode())) == a
        assert Membership.decode(peer.store_claim(epoch_key(1), b.encode())) == a   # the first claim won
        assert Membership.decode(peer.store_get_verified_nowait(epoch_key(1))) == a
        assert peer.store_get_verified_nowait(epoch_key(2)) is None
        host.store_set(epoch_key(2), b"\0" * 32 + b.encode())                       # no valid MAC
        # a TCPStore set is not acknowledged: the writer's own next request is its round trip (one connection is
        # served in order), after which every client sees it (without it: 1 run in ~60 under load saw no entry)
        assert host.store_get_nowait(epoch_key(2)) is not None
        with pytest.raises(RendezvousError, match="failed the token check"):
            peer.store_get_verified_nowait(epoch_key(2))
    finally:
        peer.close(linger_s=0.1)
        host.close(linger_s=0.1)


def test_ranks_that_loaded_different_checkpoints_fail_the_formation_naming_the_part():
    from dwdp_runtime.elastic.entry import claim_fingerprint
    from dwdp_runtime.elastic.records import GroupFingerprint

    port = free_port()
    host = StoreRendezvous(host="127.0.0.1", port=port, rank=0, world_size=2, job="f", token="t", timeout_s=10)
    peer = StoreRendezvous(host="127.0.0.1", port=port, rank=1, world_size=2, job="f", token="t", timeout_s=10)
    try:
        mine = GroupFingerprint.of(layout={"d": 2}, checkpoint="abc", dtype="bfloat16")
        claim_fingerprint(host, mine)
        claim_fingerprint(peer, GroupFingerprint.of(layout={"d": 2}, checkpoint="abc", dtype="bfloat16"))  # equal
        other = GroupFingerprint.of(layout={"d": 2}, checkpoint="xyz", dtype="float32")
        with pytest.raises(RendezvousError, match=r"differs from the group's other ranks in checkpoint, dtype"):
            claim_fingerprint(peer, other)
        assert GroupFingerprint.decode(mine.encode()) == mine and mine.differences(mine) == []
    finally:
        peer.close(linger_s=0.1)
        host.close(linger_s=0.1)
