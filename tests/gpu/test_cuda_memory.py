"""CudaMemory and CudaStreams in one process: real driver calls, zero-copy tensors, clear failures."""

from __future__ import annotations

import logging
import os

import pytest

pytestmark = pytest.mark.gpu


def _mem(device, handle_type="posix_fd"):
    from dwdp_runtime.memory.cuda import CudaMemory

    return CudaMemory(device=device, handle_type=handle_type)


def test_granularity_and_zero_copy_composite(cuda_device):
    """Two whole handles mapped back to back, one access-set call, tensors with data_ptr == va."""
    import torch

    mem = _mem(cuda_device)
    g = mem.granularity
    assert g == 2 << 20, f"H200 granularity is 2 MiB (docs/DRIVER_FACTS.md), got {g}"
    a1, a2 = mem.create(g), mem.create(2 * g)
    va = mem.reserve(3 * g)
    try:
        mem.map(va, a1)
        mem.map(va + g, a2)
        mem.set_access(va, 3 * g, writable=True)
        for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.float16):
            item = torch.empty((), dtype=dtype).element_size()
            n = 3 * g // item
            t = mem.as_tensor(va, (n,), dtype)
            assert t.data_ptr() == va and t.device == cuda_device and t.dtype == dtype
        t = mem.as_tensor(va, (3 * g // 2,), torch.bfloat16)
        ref = torch.randn(t.shape, device=cuda_device).to(torch.bfloat16)
        t.copy_(ref)
        # a second, independent view over the second handle sees the same bytes: memory, not a copy
        t2 = mem.as_tensor(va + g, (g,), torch.bfloat16)
        assert torch.equal(t2, ref[g // 2:])
        assert mem.stats["set_access"] == 1
    finally:
        mem.unmap(va, g)
        mem.unmap(va + g, 2 * g)
        mem.free_reservation(va, 3 * g)
        mem.release(a1)
        mem.release(a2)


def test_partial_map_is_refused(cuda_device):
    """The driver maps a handle only whole (docs/DRIVER_FACTS.md): a wrong-size import fails in map()."""
    from dwdp_runtime.memory.cuda import CudaError

    mem = _mem(cuda_device)
    g = mem.granularity
    alloc = mem.create(2 * g)
    fd = mem.export(alloc)
    peer = mem.import_(fd, g)  # claims half the size
    va = mem.reserve(g)
    try:
        with pytest.raises(CudaError, match="cuMemMap"):
            mem.map(va, peer)
    finally:
        mem.free_reservation(va, g)
        mem.release(peer)
        mem.release(alloc)


def test_export_import_read_only_view(cuda_device):
    """An fd export imported again maps to a second address with the same bytes (read view)."""
    import torch

    mem = _mem(cuda_device)
    g = mem.granularity
    alloc = mem.create(g)
    va = mem.reserve(g)
    mem.map(va, alloc)
    mem.set_access(va, g)
    src = mem.as_tensor(va, (g // 4,), torch.float32)
    src.copy_(torch.arange(g // 4, device=cuda_device, dtype=torch.float32))
    fd = mem.export(alloc)
    assert isinstance(fd, int)
    peer = mem.import_(fd, g)
    with pytest.raises(OSError):
        os.fstat(fd)  # import_ consumed (closed) the fd
    pva = mem.reserve(g)
    try:
        mem.map(pva, peer)
        mem.set_access(pva, g, writable=False)
        view = mem.as_tensor(pva, (g // 4,), torch.float32)
        assert view.data_ptr() == pva != va
        assert torch.equal(view, src)
    finally:
        mem.unmap(pva, g)
        mem.free_reservation(pva, g)
        mem.release(peer)
        mem.unmap(va, g)
        mem.free_reservation(va, g)
        mem.release(alloc)


def test_fabric_fails_with_a_clear_message(cuda_device):
    from dwdp_runtime.memory import BackendUnavailable, imex_channel_present, select_backend

    if imex_channel_present():
        pytest.skip("this machine has an IMEX channel: fabric may work here")
    with pytest.raises(BackendUnavailable) as info:
        select_backend("fabric", device=cuda_device)
    msg = str(info.value)
    assert "IMEX" in msg and "posix_fd" in msg, msg


def test_auto_picks_posix_fd_and_logs_once(cuda_device, caplog):
    from dwdp_runtime.memory import select_backend

    with caplog.at_level(logging.INFO, logger="dwdp_runtime.memory"):
        mem = select_backend("auto", device=cuda_device)
    assert mem.name == "cuda/posix_fd" and mem.handle_transport == "fd"
    choices = [r for r in caplog.records if "DWDP memory backend" in r.getMessage()]
    assert len(choices) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("transfer", ["copy_engine", "batched"])
def test_streams_copy_and_events(cuda_device, transfer):
    """Compiled copies on the copy stream, ordered by events only; bitwise result; no allocation."""
    import torch

    from dwdp_runtime.cuda_streams import CudaStreams

    st = CudaStreams(device=cuda_device, transfer=transfer)
    assert st._raw_stream is not None, "raw event path should resolve on torch 2.11 + CUDA 13"
    src = torch.randn(1 << 22, device=cuda_device)
    dst = torch.zeros_like(src)
    n = src.numel() * 4
    step = 1 << 20  # 1 MiB pieces, shuffled order: a batch has no internal order
    pieces = [(dst.data_ptr() + o, src.data_ptr() + o, min(step, n - o)) for o in range(0, n, step)][::-1]
    compiled = st.compile(pieces)
    ready, done = st.new_event(), st.new_event()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(cuda_device).get("allocation.all.allocated", 0)
    for _ in range(3):
        st.wait_copy(done)
        st.enqueue_copies(compiled)
        st.record_copy(ready)
        st.wait_compute(ready)
        st.record_compute(done)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(cuda_device).get("allocation.all.allocated", 0) == before
    assert torch.equal(dst, src)
    # the raw record/wait path honours the caller's current stream (a higher-priority one here)
    hp = torch.cuda.Stream(device=cuda_device, priority=-1)
    torch.cuda.synchronize()
    with torch.cuda.stream(hp):
        torch.cuda._sleep(1_000_000)  # the compute stream's write to dst lands late...
        dst.zero_()
        st.record_compute(done)
        st.wait_copy(done)  # ...and the copy must still come after it (WAR through `done`)
        st.enqueue_copies(compiled)
        st.record_copy(ready)
        st.wait_compute(ready)  # RAW: the clone reads the copied bytes
        got = dst.clone()
    torch.cuda.synchronize()
    assert torch.equal(got, src)
    assert st.stats["synchronize"] == 0 and st.stats["copy_bytes"] == 4 * n
    st.close()


def _cutlass_missing() -> str | None:
    """Why CuTe DSL cannot be used here (None when ``import cutlass.cute`` works)."""
    try:
        import cutlass.cute  # noqa: F401  (nvidia-cutlass-dsl)
    except Exception as exc:  # noqa: BLE001
        return f"nvidia-cutlass-dsl is not importable ({type(exc).__name__}: {exc})"
    return None


def test_sm_gather_copies_bitwise_or_is_refused_at_setup(cuda_device):
    """Where CuTe DSL imports: the gather kernel copies a ragged plan bitwise, on the copy stream, with
    no allocation or sync per launch, for any CTA count; bytes outside the plan stay untouched; a
    misaligned plan is refused at compile (setup). Where it does not: refused at setup, with the reason."""
    import torch

    from dwdp_runtime.cuda_streams import CudaStreams
    from dwdp_runtime.sm_gather import CHUNK_LINES, LINE_BYTES, SmGather, SmGatherUnavailable

    missing = _cutlass_missing()
    if missing:
        with pytest.raises(SmGatherUnavailable, match="copy_engine"):
            CudaStreams(device=cuda_device, transfer="sm_gather")
        return
    st = CudaStreams(device=cuda_device, transfer="sm_gather")
    chunk = CHUNK_LINES * LINE_BYTES
    # full rows, tails, single lines, a multi-MiB entry; scattered, shuffled, non-contiguous
    sizes = [16, 48, chunk, chunk + 16, 3 * chunk - 32, (5 << 20) + 4096 + 16, 144, 2 * chunk, 7 * 16]
    g = torch.Generator().manual_seed(3)
    total = sum(sizes)
    src = torch.randint(-2**31, 2**31 - 1, ((2 * total + (1 << 20)) // 4,), generator=g, dtype=torch.int32)
    src = src.to(cuda_device)
    dst = torch.zeros((total + 4096 * len(sizes)) // 4, dtype=torch.int32, device=cuda_device)
    sb, db = src.view(torch.uint8), dst.view(torch.uint8)
    pieces, ref = [], torch.zeros_like(db)
    d_off, s_off = 0, 64
    for n in sizes:
        pieces.append((db.data_ptr() + d_off, sb.data_ptr() + s_off, n))
        ref[d_off:d_off + n] = sb[s_off:s_off + n]
        d_off += n + 4096  # gaps in dst must stay zero
        s_off += n + 1024 + 16 * (n % 7)
    pieces = pieces[::-1]
    compiled = st.compile(pieces)
    with pytest.raises(ValueError, match="copy_engine"):
        st.compile([(db.data_ptr() + 8, sb.data_ptr(), 16)])
    ready, done = st.new_event(), st.new_event()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(cuda_device).get("allocation.all.allocated", 0)
    for _ in range(3):
        st.wait_copy(done)
        st.enqueue_copies(compiled)
        st.record_copy(ready)
        st.wait_compute(ready)
        st.record_compute(done)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(cuda_device).get("allocation.all.allocated", 0) == before
    assert st.stats["synchronize"] == 0 and st.stats["copy_bytes"] == 3 * total
    assert torch.equal(db, ref)
    # RAW through events only: the copy stream is delayed, the reader must still see the bytes
    dst.zero_()
    torch.cuda.synchronize()
    st.wait_copy(done)
    with torch.cuda.stream(st.copy_stream):
        torch.cuda._sleep(2_000_000)
    st.enqueue_copies(compiled)
    st.record_copy(ready)
    st.wait_compute(ready)
    got = db.clone()
    torch.cuda.synchronize()
    assert torch.equal(got, ref)
    st.close()
    # the grid size is a parameter: 1 CTA (every row walked by one block), more CTAs than rows, and
    # 0 = one CTA per row
    for ctas in (1, 132, 1000, 0):
        gather = SmGather(device=cuda_device, ctas=ctas)
        plan = gather.compile(pieces)
        dst.zero_()
        side = torch.cuda.Stream(device=cuda_device)
        side.wait_stream(torch.cuda.current_stream())
        gather.launch(plan, side)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(db, ref), f"ctas={ctas}"
