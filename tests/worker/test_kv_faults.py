"""KV handoff faults, with a real NIXL service in its own process and the reference client here."""

from __future__ import annotations

import time

import pytest

from dwdp_worker.kv.nixl_api import nixl_installed
import torch

from tests.timing import hold
from tests.processes import context, process
from .kv_programs import KvServerProcess as Server
from .kv_programs import mapped_regions, open_fds, settle

# the kv extra installs nixl-cu13, whose module is nixl_cu13 (only the `nixl` meta package provides `nixl`)
if not nixl_installed():
    pytest.skip("KV transfer tests need NIXL (the kv extra)", allow_module_level=True)

from dwdp_worker.kv.client import KvPuller, KvPullError  # noqa: E402


#: the default entries' TTL: far longer than a test's keep → connect → claim on a loaded 2-core machine (a new
#: NIXL agent alone can take a second there); the TTL test itself asks for SHORT_TTL_S
LONG_TTL_S = 30.0
SHORT_TTL_S = 1.0


@pytest.fixture
def server(request):
    s = Server(**getattr(request, "param", dict(budget_bytes=1 << 20, block_bytes=4096, ttl_s=LONG_TTL_S)))
    yield s
    if s.proc.is_alive():
        s.proc.kill()
        s.proc.join()


@pytest.mark.parametrize("server", [dict(budget_bytes=1 << 20, block_bytes=4096, ttl_s=SHORT_TTL_S)], indirect=True)
def test_decode_side_never_comes_ttl_frees_and_late_pull_says_expired(server):
    status, params, _ = server.keep("never")
    assert status == "ok" and server.stats()["held_sequences"] == 1
    deadline = time.monotonic() + 10
    while server.stats()["held_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = server.stats()
    assert (s["held_sequences"], s["held_bytes"], s["expirations_total"]) == (0, 0, 1)
    with KvPuller() as puller:
        with pytest.raises(KvPullError, match="refused request never: expired"):
            puller.pull(params)


def test_unknown_and_repeated_pulls_are_clear_errors(server):
    _, params, kv = server.keep("once", seq_len=9, seed=3)
    with KvPuller() as puller:
        got = puller.pull(params)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, got.kv))
        with pytest.raises(KvPullError, match="already pulled"):
            puller.pull(params)
        with pytest.raises(KvPullError, match="unknown request id"):
            puller.pull({**params, "request_id": "nobody"})
    s = server.stats()
    assert (s["pulls_total"], s["held_sequences"], s["refusals_total"]) == (1, 0, 2)


def test_pull_from_a_dead_or_restarted_rank_fails_cleanly(server):
    _, params, _ = server.keep("orphan")
    server.proc.kill()                      # the group restarts: this rank's agent is gone
    server.proc.join()
    restarted = Server(budget_bytes=1 << 20, block_bytes=4096, ttl_s=LONG_TTL_S)
    try:
        assert restarted.engine_id != params["remote_engine_id"]
        with KvPuller() as puller:
            t0 = time.monotonic()
            with pytest.raises(KvPullError, match="gone, restarted|unreachable"):
                puller.pull(params, claim_timeout_s=2.0)
            assert time.monotonic() - t0 < 10
            _, fresh, _ = restarted.keep("fresh")       # the restarted rank serves new requests
            assert puller.pull(fresh).nbytes == fresh["stream_bytes"]
    finally:
        restarted.stop()


@pytest.mark.parametrize("server", [dict(budget_bytes=1 << 20, block_bytes=4096, ttl_s=30.0, peer_idle_s=0.2)],
                         indirect=True)
def test_nothing_leaks_across_1000_requests(server):
    puller = KvPuller()
    for i in range(20):                                  # warm-up: connections, allocator pools
        puller.pull(server.keep(f"w{i}", seq_len=1 + i % 13, seed=i)[1])
    settle(server)
    base, client_fds, client_maps = server.stats(), open_fds(), mapped_regions()
    for i in range(1000):
        if i % 250 == 0:                                 # a new decode agent now and then: peers come and go
            puller.close()
            puller = KvPuller()
        status, params, kv = server.keep(f"r{i}", seq_len=1 + i % 13, seed=i)
        assert status == "ok"
        got = puller.pull(params)
        if i % 100 == 0:
            assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, got.kv))
    puller.close()
    s = settle(server)
    assert (s["pulls_total"] - base["pulls_total"], s["held_sequences"], s["held_bytes"]) == (1000, 0, 0)
    assert s["peers"] == 0
    assert s["fds"] <= base["fds"] + 2, (base["fds"], s["fds"])
    assert s["maps"] <= base["maps"] + 16, (base["maps"], s["maps"])
    assert open_fds() <= client_fds + 8 and mapped_regions() <= client_maps + 64


def _pull_with_kill(params, pid, conn):
    """A decode process whose rank is SIGKILLed between the claim and the READ (its own process: the NIXL
    agent of a client that saw a rank die mid-transfer has once aborted in its destructor, docs/KV_TRANSFER.md)."""
    import os
    import signal

    from dwdp_worker.kv.client import KvPuller, KvPullError

    t0 = time.monotonic()
    puller = KvPuller()
    try:
        puller.pull(params, after_claim=lambda: (os.kill(pid, signal.SIGKILL), hold(0.5, "the rank is dead before the READ")), read_timeout_s=5.0)
        conn.send(("no error", time.monotonic() - t0))
    except KvPullError as exc:
        conn.send((str(exc), time.monotonic() - t0))
    os._exit(0)  # sent synchronously (a pipe): nothing is lost


@pytest.mark.parametrize("server", [dict(budget_bytes=1 << 20, block_bytes=4096, ttl_s=60.0)], indirect=True)
def test_rank_dying_between_claim_and_read_fails_the_pull_cleanly(server):
    _, params, _ = server.keep("mid")
    here, there = context().Pipe()
    proc = process(_pull_with_kill, (params, server.proc.pid, there), daemon=False)
    proc.start()
    assert here.poll(60), f"the decode process sent nothing (exit code {proc.exitcode})"
    message, took = here.recv()
    proc.join(10)
    assert "READ of request mid" in message and took < 20, (message, took)
