"""StoreRendezvous on a real TCPStore (ranks as threads for speed), token checks, stray clients,
and MpiRendezvous under a real mpirun."""

import re
import shutil
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from dwdp_runtime.rendezvous import RendezvousError, RendezvousTimeout, StoreRendezvous

from tests.timing import LOADED_SLACK_S, hold
from .group import free_port

ROOT = Path(__file__).resolve().parents[2]


def _ranks(world, port, tokens=None, timeout_s=5.0, ranks=None, action=None):
    results, threads = {}, []

    def run(rank):
        try:
            with StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="j",
                                 token=(tokens or {}).get(rank, "tok"), timeout_s=timeout_s) as rdzv:
                results[rank] = action(rdzv) if action else rdzv.allgather("hello", f"r{rank}".encode())
        except Exception as exc:  # noqa: BLE001
            results[rank] = exc

    for r in ranks if ranks is not None else range(world):
        threads.append(threading.Thread(target=run, args=(r,)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return results


def test_allgather_orders_by_rank():
    res = _ranks(3, free_port())
    assert all(res[r] == [b"r0", b"r1", b"r2"] for r in range(3))


def test_missing_rank_is_named():
    res = _ranks(3, free_port(), ranks=[0, 2], timeout_s=1.5)
    for r in (0, 2):
        assert isinstance(res[r], RendezvousTimeout) and res[r].missing == [1]
        assert "rank(s) [1] never arrived" in str(res[r])


def test_wrong_token_cannot_join():
    res = _ranks(2, free_port(), tokens={1: "not-the-token"}, timeout_s=1.5)
    assert isinstance(res[0], RendezvousTimeout) and res[0].missing == [1]
    assert isinstance(res[1], RendezvousTimeout) and res[1].missing == [0]


def test_forged_entry_is_rejected():
    port = free_port()
    barrier = threading.Barrier(2)

    def forge_then_gather(rdzv):
        if rdzv.rank == 0:
            # a client that knows the key names but not the token writes rank 1's entry first
            stranger = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
            stranger.set(rdzv._prefix + "x/1", b"\0" * 32 + b"evil")
            barrier.wait()
            return rdzv.allgather("x", b"good0")
        barrier.wait()
        return "rank 1 stayed away"

    res = _ranks(2, port, action=forge_then_gather, timeout_s=3)
    assert isinstance(res[0], RendezvousError) and "failed the token check" in str(res[0])


def test_stray_tcp_client_does_not_disturb_the_group():
    port = free_port()

    def gather_with_noise(rdzv):
        if rdzv.rank == 1:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
        return rdzv.allgather("after-noise", f"r{rdzv.rank}".encode())

    res = _ranks(2, port, action=gather_with_noise)
    assert res == {0: [b"r0", b"r1"], 1: [b"r0", b"r1"]}


def test_unreachable_store_fails_with_a_fix():
    with pytest.raises(RendezvousError, match="could not reach the rendezvous store"):
        StoreRendezvous(host="127.0.0.1", port=free_port(), rank=1, world_size=2, timeout_s=1)


def test_a_rank_arriving_before_the_store_joins_as_soon_as_it_listens():
    """The TCPStore client's own retry of a refused port backs off ~0.1-1 s; the rendezvous polls the port
    itself (``wait_for_port``), so a joining rank is in as soon as rank 0 hosts the store."""
    import time

    from dwdp_runtime import rendezvous

    port, host_delay_s = free_port(), 0.3
    started = threading.Event()
    joined = {}

    def join():
        started.set()
        t0 = time.monotonic()
        with StoreRendezvous(host="127.0.0.1", port=port, rank=1, world_size=2, job="j", token="tok",
                             timeout_s=10) as rdzv:
            joined["after_s"] = time.monotonic() - t0
            joined["got"] = rdzv.allgather("hello", b"r1")

    client = threading.Thread(target=join)
    client.start()
    started.wait(5)
    hold(host_delay_s, "the store's host arrives late")
    with StoreRendezvous(host="127.0.0.1", port=port, rank=0, world_size=2, job="j", token="tok",
                         timeout_s=10) as rdzv:
        got = rdzv.allgather("hello", b"r0")
    client.join(20)
    assert got == joined["got"] == [b"r0", b"r1"]
    late_s = joined["after_s"] - host_delay_s
    print(f"rank 1 joined {late_s:.3f} s after the store listened")
    assert late_s < LOADED_SLACK_S, f"rank 1 joined {late_s:.3f} s after the store listened"
    assert rendezvous.wait_for_port("127.0.0.1", free_port(), timeout_s=0.05) is False


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no MPI launcher (pip install mpich)")
def test_mpi_rendezvous_under_mpirun():
    out = subprocess.run(["mpirun", "-n", "3", sys.executable, "-m", "tests.runtime.mpi_program", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # mpirun merges the ranks' stdout: lines may interleave, so find each report anywhere
    lines = sorted(re.findall(r"group=\d+ rank=\d+ ok=\d+/\d+", out.stdout))
    assert lines == [f"group=0 rank={r} ok=6/6" for r in range(3)]
