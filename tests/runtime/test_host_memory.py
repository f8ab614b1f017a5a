"""Host backend: real memfd + mmap, whole-allocation mapping, zero-copy tensors, fd passing."""

import os
import time

import pytest
import torch

from dwdp_runtime.fdpass import FdPassError, FdServer, fetch_fds
from dwdp_runtime.memory import HostMemory, select_backend
from dwdp_runtime.rendezvous import token_key


def test_composite_of_two_allocations_is_one_zero_copy_tensor():
    mem = HostMemory(granularity=4096)
    a, b = mem.create(8192), mem.create(4096)
    va = mem.reserve(12288)
    mem.map(va, a)
    mem.map(va + 8192, b)
    mem.set_access(va, 12288)
    t = mem.as_tensor(va, (3, 1024), torch.float32)
    assert t.data_ptr() == va
    t[:] = torch.arange(3 * 1024, dtype=torch.float32).view(3, 1024)
    # a second mapping of allocation b elsewhere sees the same bytes (shared physical memory)
    va2 = mem.reserve(4096)
    mem.map(va2, b)
    mem.set_access(va2, 4096, writable=False)
    assert torch.equal(mem.as_tensor(va2, (1024,), torch.float32), t[2])
    for v, n in ((va, 12288), (va2, 4096)):
        mem.unmap(v, n)
        mem.free_reservation(v, n)
    mem.release(a)
    mem.release(b)
    mem.release(b)  # idempotent


def test_sizes_must_be_whole_granules():
    mem = HostMemory(granularity=8192)
    with pytest.raises(ValueError, match="multiple of the granularity"):
        mem.create(4096)
    with pytest.raises(ValueError, match="multiple of the OS page size"):
        HostMemory(granularity=1000)


def test_bfloat16_view_is_zero_copy():
    mem = HostMemory()
    a = mem.create(4096)
    va = mem.reserve(4096)
    mem.map(va, a)
    mem.set_access(va, 4096)
    t = mem.as_tensor(va, (2, 1024), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == va


def test_fd_passing_requires_the_token():
    mem = HostMemory()
    a = mem.create(4096)
    fd = mem.export(a)
    server = FdServer([fd], token_key=token_key("right"))
    try:
        with pytest.raises(FdPassError, match="token mismatch"):
            fetch_fds(server.name, token_key=token_key("wrong"))
        (got,) = fetch_fds(server.name, token_key=token_key("right"))
        b = mem.import_(got, 4096)
        va = mem.reserve(4096)
        mem.map(va, b)
        mem.set_access(va, 4096)
        va_a = mem.reserve(4096)
        mem.map(va_a, a)
        mem.set_access(va_a, 4096)
        mem.as_tensor(va_a, (1024,), torch.int32).fill_(7)
        assert int(mem.as_tensor(va, (1024,), torch.int32).sum()) == 7 * 1024
        deadline = time.monotonic() + 5  # the server thread counts after the client's ack
        while server.served < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused == 1 and server.served == 1
    finally:
        server.close()
        os.close(fd)


def test_select_backend_auto_on_cpu_is_host():
    assert select_backend("auto").name == "host"
    with pytest.raises(ValueError, match="unknown memory backend"):
        select_backend("nvme")


def test_granularity_choice_and_tensor_bytes_shared_by_both_backends():
    from dwdp_runtime.memory.base import choose_granularity, nbytes_of

    h200 = 2 << 20  # the driver's recommended granularity on H200 (docs/DRIVER_FACTS.md)
    assert choose_granularity(None, h200, what="the driver granularity") == h200
    assert choose_granularity(4 * h200, h200, what="the driver granularity") == 4 * h200
    with pytest.raises(ValueError, match="multiple of the driver granularity 2097152"):
        choose_granularity(4096, h200, what="the driver granularity")  # was silently ignored on CUDA
    assert nbytes_of((3, 5), torch.bfloat16) == torch.empty(3, 5, dtype=torch.bfloat16).nbytes == 30
    assert nbytes_of((), torch.float32) == 4 and nbytes_of((0, 7), torch.float64) == 0
    with pytest.raises(ValueError, match="positive multiple of the granularity 4096"):
        HostMemory(granularity=4096).reserve(0)


#: an accept poll no close may wait out (far above fdpass.CLOSE_JOIN_S)
LONG_ACCEPT_POLL_S = 30.0


def test_closing_an_fd_server_wakes_its_accept_instead_of_waiting_out_the_poll(monkeypatch):
    """A group's setup closes one server per rank: close must not cost the accept poll (fdpass docstring). With the
    poll made long, a close that did not wake its accept would wait out the join bound and leave the thread alive;
    the wake-up connection is queued before close returns, so a thread not yet in accept finds it there too."""
    from dwdp_runtime import fdpass

    monkeypatch.setattr(fdpass, "ACCEPT_POLL_S", LONG_ACCEPT_POLL_S)
    r, w = os.pipe()
    try:
        servers = [FdServer([r], token_key=token_key("t")) for _ in range(5)]
        t0 = time.perf_counter()
        for s in servers:
            s.close()
        took = time.perf_counter() - t0
        assert not any(s._thread.is_alive() for s in servers)
        assert took < fdpass.CLOSE_JOIN_S, f"5 closes took {took:.3f} s: one waited for its join bound"
        with pytest.raises(OSError):
            fetch_fds(servers[0].name, token_key=token_key("t"), timeout_s=1)
    finally:
        os.close(r)
        os.close(w)
