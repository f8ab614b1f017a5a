"""Membership epochs over a real TCPStore: one winner per epoch, convergence on the union of losses, fencing."""

from __future__ import annotations

import pytest

from dwdp_runtime.membership import Membership, epoch_key, next_membership
from dwdp_runtime.rendezvous import RendezvousError, StoreRendezvous
from tests.runtime.group import free_port


def test_next_membership_only_shrinks_and_counts_epochs():
    full = Membership.full(4)
    assert full == Membership(0, frozenset({0, 1, 2, 3}))
    assert next_membership(full, ()) is None
    one = next_membership(full, {1})
    assert one == Membership(1, frozenset({0, 2, 3}))
    assert next_membership(one, {1}) is None                  # already out: no new epoch
    assert next_membership(one, {1, 3}) == Membership(2, frozenset({0, 2}))
    assert Membership.decode(one.encode()) == one


def test_one_claim_wins_per_epoch_and_a_forged_entry_is_refused():
    port = free_port()
    host = StoreRendezvous(host="127.0.0.1", port=port, rank=0, world_size=2, job="m", token="t", timeout_s=10)
    peer = StoreRendezvous(host="127.0.0.1", port=port, rank=1, world_size=2, job="m", token="t", timeout_s=10)
    try:
        a = Membership(1, frozenset({0, 2, 3}))
        b = Membership(1, frozenset({0, 2}))
        assert Membership.decode(host.store_claim(epoch_key(1), a.encode())) == a
        assert Membership.decode(peer.store_claim(epoch_key(1), b.encode())) == a   # the first claim won
        assert Membership.decode(peer.store_get_verified_nowait(epoch_key(1))) == a
        assert peer.store_get_verified_nowait(epoch_key(2)) is None
        host.store_set(epoch_key(2), b"\0" * 32 + b.encode())                       # no valid MAC
        with pytest.raises(RendezvousError, match="failed the token check"):
            peer.store_get_verified_nowait(epoch_key(2))
    finally:
        peer.close(linger_s=0.1)
        host.close(linger_s=0.1)
