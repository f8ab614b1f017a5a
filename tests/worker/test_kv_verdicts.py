"""A decode side can always tell valid KV from stale (docs/KV_TRANSFER.md, "Why a verdict"): a real NIXL service in
its own process, decode agents here. Each test asserts what the decode side sees.

The region of most tests holds exactly one sequence (one 4 KiB block), so a sequence kept after a lapse lands in the
very blocks a late READ reads: the danger is real, and the verdict is what catches it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dwdp_worker.kv.nixl_api import nixl_installed

from tests.timing import hold
from .kv_programs import KvServerProcess

if not nixl_installed():
    pytest.skip("KV transfer tests need NIXL (the kv extra)", allow_module_level=True)

from dwdp_worker.kv.client import Claim, KvPuller, KvPullError, parse_params  # noqa: E402
from dwdp_worker.kv.layout import read_stream  # noqa: E402
from dwdp_worker.kv.params import AgentMessage, AgentOp  # noqa: E402

BLOCK = 4096
#: leases short enough to lapse within a test, long enough for a claim round trip on a loaded 2-core machine
LEASE_S = 1.5
#: grace longer than the checks made inside it (a stats round trip), so "still in quarantine" is not a race
GRACE_S = 5.0


def same(a, b) -> bool:
    return all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


def wait_until(cond, timeout_s=20.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.05)
    return got


@pytest.fixture
def one_block():
    s = KvServerProcess(budget_bytes=BLOCK, block_bytes=BLOCK, ttl_s=30.0, lease_s=LEASE_S, grace_s=GRACE_S)
    yield s
    s.kill()


def test_a_late_read_after_the_lapse_is_stale_and_the_new_owner_is_intact(one_block):
    server = one_block
    _, old, old_kv = server.keep("old", seed=1)
    with KvPuller() as late, KvPuller() as other:
        claim = late.claim(old)                                  # a consumer that READs whatever its clock says
        wait_until(lambda: server.stats()["expirations_total"] == 1, what="the lease to lapse")
        status, message, _ = server.keep("blocked", seed=3)      # the lapsed blocks wait out the grace period
        assert status == "full" and "grace period" in message
        new = wait_until(lambda: (r := server.keep("new", seed=2))[0] == "ok" and r, what="the grace to end")
        _, new_params, new_kv = new
        assert new_params["remote_block_ids"] == old["remote_block_ids"]   # the very blocks the late READ names
        dst, _, _ = late.read(claim)
        seen = read_stream(dst[:old["stream_bytes"]], claim.params.tensors)
        assert same(seen, new_kv) and not same(seen, old_kv)     # it did read another request's KV …
        with pytest.raises(KvPullError, match="answered stale for request old: lease lapsed"):
            late.await_verdict(claim)                            # … and the rank says so
        pulled = other.pull(new_params)                          # the new owner's KV: intact and pullable
        assert same(pulled.kv, new_kv)
    s = server.stats()
    assert (s["stale_total"], s["pulls_total"], s["expirations_total"], s["held_bytes"]) == (1, 1, 1, 0)


def test_the_reference_client_never_reads_after_its_lease_on_its_own_clock(one_block):
    _, params, _ = one_block.keep("slow", seed=1)
    with KvPuller() as puller:
        with pytest.raises(KvPullError, match="lease on request slow lapsed before the READ could start"):
            puller.pull(params, after_claim=lambda: hold(LEASE_S + 0.2, "a stalled decode process"))   # a stalled decode process
    assert one_block.stats()["stale_total"] == 0                 # nothing was read, nothing to judge


def test_a_read_racing_the_lapse_is_stale_and_read_its_own_bytes(one_block):
    """The READ is posted inside the lease; the rank handles its `pulled` only after the lease ran out (it is
    stopped meanwhile: a stalled rank, a notification delivered late). The lapse wins the race."""
    server = one_block
    _, params, kv = server.keep("race", seed=1)
    pid = server.proc.pid
    with KvPuller() as puller:
        claim = puller.claim(params)
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(LEASE_S + 0.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            t_post = time.monotonic()
            assert t_post - claim.t_claimed < LEASE_S                # issued inside the lease
            dst, _, _ = puller.read(claim)
            with pytest.raises(KvPullError, match="answered stale for request race: lease lapsed"):
                puller.await_verdict(claim)
        finally:
            resume.join()
            os.kill(pid, signal.SIGCONT)
        # the blocks sat in quarantine: the racing READ got its own request's bytes, never another tenant's
        assert same(read_stream(dst[:params["stream_bytes"]], claim.params.tensors), kv)
        status, message, _ = server.keep("during-grace")
        assert status == "full" and "grace period" in message
    s = server.stats()
    assert (s["stale_total"], s["pulls_total"], s["expirations_total"]) == (1, 0, 1)


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_a_consumer_with_a_skewed_clock(one_block, monkeypatch, skew_s):
    """This host's wall clock is an hour off. The reference client does not read it: its pull is valid. A consumer
    that trusts ``lease_until`` with that clock misjudges its lease; the verdict still tells it the truth."""
    server = one_block
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    _, params, kv = server.keep("fine", seed=1)
    assert params["expires_at"] - time.time() == pytest.approx(params["ttl_s"] - skew_s, abs=5)  # looks wrong here
    with KvPuller() as puller:
        assert same(puller.pull(params).kv, kv)
        _, params2, _ = server.keep("misjudged", seed=2)
        claim = puller.claim(params2)
        thinks_left = claim.lease_until - time.time()             # what a clock-trusting consumer computes
        if skew_s < 0:                                            # behind: it believes it has an hour and dawdles
            assert thinks_left > 3000
            hold(LEASE_S + 0.3, "the consumer dawdles past its lease")
            dst, _, _ = puller.read(claim)
            with pytest.raises(KvPullError, match="answered stale for request misjudged: lease lapsed"):
                puller.await_verdict(claim)
        else:                                                     # ahead: it believes the lease is long gone,
            assert thinks_left < -3000                            # yet the rank's clock says valid
            dst, _, _ = puller.read(claim)
            puller.await_verdict(claim)
    s = server.stats()
    assert (s["pulls_total"], s["stale_total"]) == ((1, 1) if skew_s < 0 else (2, 0))


def test_a_stale_pulled_from_a_stranger_changes_nothing():
    server = KvServerProcess(budget_bytes=8 * BLOCK, block_bytes=BLOCK, ttl_s=30.0, lease_s=30.0, grace_s=GRACE_S)
    try:
        _, p1, kv1 = server.keep("r1", seed=1)
        _, p2, kv2 = server.keep("r2", seed=2)
        with KvPuller() as a, KvPuller() as b, KvPuller() as c:
            claim_a = a.claim(p1)
            claim_b = b.claim(p2)                                 # b is known to the rank (it claimed r2)
            for nonce in (claim_b.nonce, claim_a.nonce):          # its own nonce, or a guessed one: not its claim
                forged = Claim(params=parse_params(p1), remote=claim_b.remote, nonce=nonce, lease_s=30.0,
                               t_sent=0.0, t_claimed=0.0)
                b.send(forged.remote, AgentMessage(op=AgentOp.PULLED, request_id="r1", nonce=nonce))
                with pytest.raises(KvPullError, match="stale for request r1: this pull does not hold the claim"):
                    b.await_verdict(forged)
            # an agent that never claimed here: the rank has no address to answer; its wait ends, bounded
            remote = c._connect(parse_params(p2))
            c.send(remote, AgentMessage(op=AgentOp.PULLED, request_id="r2", nonce="guess"))
            silent = Claim(params=parse_params(p2), remote=remote, nonce="guess", lease_s=30.0, t_sent=0.0,
                           t_claimed=0.0)
            with pytest.raises(KvPullError, match="no verdict from context rank"):
                c.await_verdict(silent, timeout_s=1.0)
            # the claim holders are untouched: both pulls are valid and bitwise
            dst, _, _ = a.read(claim_a)
            a.await_verdict(claim_a)
            assert same(read_stream(dst[:p1["stream_bytes"]], claim_a.params.tensors), kv1)
            dst, _, _ = b.read(claim_b)
            b.await_verdict(claim_b)
            assert same(read_stream(dst[:p2["stream_bytes"]], claim_b.params.tensors), kv2)
            a.send(claim_a.remote, AgentMessage(op=AgentOp.PULLED, request_id="r1", nonce=claim_a.nonce))
            with pytest.raises(KvPullError, match="already confirmed and freed"):   # a second READ's confirmation
                a.await_verdict(claim_a)
        s = server.stats()   # stale: b's two forgeries, c's unanswerable one, a's second confirmation
        assert (s["pulls_total"], s["stale_total"], s["held_sequences"], s["quarantined_bytes"]) == (2, 4, 0, 0)
    finally:
        server.kill()


#: the fields of a dwdp-kv/1 notification, exactly: a v1 consumer refuses anything else
V1_FIELDS = {"op", "request_id", "nonce", "metadata", "reason", "lease_until"}


def test_a_dwdp_kv_1_consumer_gets_a_clear_refusal_it_can_read(one_block):
    _, params, _ = one_block.keep("old-client", seed=1)
    with KvPuller() as puller:
        with pytest.raises(KvPullError, match="speak 'dwdp-kv/1'; this client speaks 'dwdp-kv/2'"):
            puller.pull({**params, "protocol": "dwdp-kv/1"})
        remote = puller._connect(parse_params(params))
        v1_claim = b'{"op": "claim", "request_id": "old-client", "nonce": "n1", "metadata": "%s"}' % \
            puller._metadata.encode()
        puller._agent.send_notif(remote, v1_claim)
        raw = wait_until(lambda: puller._agent.get_new_notifs().get(remote), what="the rank's answer")[0]
    import json

    reply = json.loads(raw)
    assert set(reply) <= V1_FIELDS and reply["op"] == "refused" and reply["nonce"] == "n1"
    assert "dwdp-kv/2" in reply["reason"] and "verdict" in reply["reason"]
    with KvPuller() as puller:                                    # never leased: a v2 pull of it still works
        puller.pull(params)


def test_service_polls_fast_only_while_a_pull_is_under_way():
    from dwdp_worker.kv.server import ACTIVE_WINDOW_S, FAST_POLL_S, POLL_S, poll_period

    assert poll_period(True, 10.0) == FAST_POLL_S            # a claim held: its verdict is waited for
    assert poll_period(False, ACTIVE_WINDOW_S / 2) == FAST_POLL_S
    assert poll_period(False, ACTIVE_WINDOW_S * 2) == POLL_S  # idle: the cheap period
    assert FAST_POLL_S < POLL_S
