"""``checkpoint.device_staging``: the chunked, double-buffered read of a checkpoint tensor's bytes (CPU here; the
pinned CUDA slots run in every GPU load, ``tests/gpu``).

``chunked_read`` over host slots with a copy that records what it moved must deliver exactly the file's bytes —
for chunk sizes that do not divide the tensor, a tensor smaller than one chunk, and a row range starting inside
the file — wait for each slot before refilling it, and leave no slot busy at the end; ``SafetensorsIndex.get`` and
``read_rows`` into CPU tensors stay the direct ``pread``, checked against `safetensors`' own reader.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dwdp_worker.checkpoint.device_staging import HostSlot, chunked_read
from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex
from tests.timing import hold


@pytest.fixture()
def index(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(37, 129, generator=g), "b": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
               "c": torch.randn(64, 8, generator=g).to(torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    with SafetensorsIndex(tmp_path) as idx:
        yield idx


class CountingSlot(HostSlot):
    """A host slot that records its waits and refuses a refill it did not wait for."""

    def __init__(self, size: int):
        super().__init__(torch.empty(size, dtype=torch.uint8))
        self.busy = False
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1
        self.busy = False

    def mark(self) -> None:
        self.busy = True


@pytest.mark.parametrize("key", ["a", "b", "c"])
@pytest.mark.parametrize("chunk", [1, 7, 100, 4096, 1 << 20])
@pytest.mark.parametrize("rows", [None, (5, 31)])
def test_chunked_read_delivers_the_files_bytes(index, key, chunk, rows):
    e = index.entries[key]
    begin, end = rows if rows and e.shape[0] >= rows[1] else (0, e.shape[0])
    row_bytes = e.nbytes // e.shape[0]
    offset, nbytes = begin * row_bytes, (end - begin) * row_bytes
    want = index.get(key)[begin:end].contiguous().view(-1).view(torch.uint8)
    dst = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    slots = [CountingSlot(chunk), CountingSlot(chunk)]
    filled = []

    def fill(done, n, buffer):
        assert not slots[len(filled) % 2].busy, "a slot was refilled before its copy finished"
        filled.append(n)
        index._pread_into(e, offset + done, n, buffer)

    chunked_read(fill, nbytes, dst, slots, lambda part, buf: part.copy_(buf), chunk_bytes=chunk)
    assert torch.equal(dst, want)
    assert sum(filled) == nbytes and all(n <= chunk for n in filled) and len(filled) == -(-nbytes // chunk)
    assert not any(s.busy for s in slots)  # every copy waited for before the read returned


def test_a_cpu_get_is_what_safetensors_reads(index):
    from safetensors.torch import load_file

    want = load_file(str(index.dir / "model.safetensors"))  # an independent reader of the same file
    for key, e in index.entries.items():
        for out in (index.get(key, "cpu"), index.get(key)):
            assert out.dtype == e.dtype and tuple(out.shape) == e.shape
            assert torch.equal(out, want[key]), key


def test_consecutive_reads_rotate_the_slots_and_leave_the_last_copies_queued(index):
    """Reads into one stager continue the rotation where the last one stopped, return with their copies still
    queued (``drain=False``: the next ``pread`` overlaps them), never refill a slot before waiting for it, and
    ``drain_slots`` leaves none busy."""
    from dwdp_worker.checkpoint.device_staging import drain_slots

    slots = [CountingSlot(100), CountingSlot(100)]
    used = []

    def reader(e, offset):
        def fill(done, n, buffer):
            which = next(i for i, s in enumerate(slots) if s.buffer.data_ptr() == buffer.data_ptr())
            assert not slots[which].busy, "a slot was refilled before its copy finished"
            used.append(which)
            index._pread_into(e, offset + done, n, buffer)
        return fill

    nxt = 0
    for key in ("a", "b", "c", "a"):
        e = index.entries[key]
        dst = torch.empty(e.nbytes, dtype=torch.uint8)
        before = len(used)
        nxt = chunked_read(reader(e, 0), e.nbytes, dst, slots, lambda part, buf: part.copy_(buf), chunk_bytes=100,
                           first_slot=nxt, drain=False)
        assert torch.equal(dst, index.get(key).contiguous().view(-1).view(torch.uint8)), key
        assert used[before:] == [(used[before - 1] + 1 + i) % 2 if before else i % 2
                                 for i in range(len(used) - before)]
        assert nxt == (used[-1] + 1) % 2
        assert slots[used[-1]].busy  # its copy is left queued for the next read to overlap
    drain_slots(slots)
    assert not any(s.busy for s in slots)


@pytest.mark.parametrize("n,threads", [(1, 4), (4096, 4), ((1 << 20) - 1, 4), (3 << 20, 4), ((16 << 20) + 5, 4),
                                       (16 << 20, 1), ((5 << 20) + 123, 3)])
def test_pieces_cover_the_chunk_in_whole_pages(n, threads):
    from dwdp_worker.checkpoint.device_staging import MIN_PIECE_BYTES, PAGE_BYTES, pieces

    parts = pieces(n, threads)
    assert [start for start, _ in parts] == [sum(length for _, length in parts[:i]) for i in range(len(parts))]
    assert sum(length for _, length in parts) == n and all(length > 0 for _, length in parts)
    assert len(parts) <= max(1, min(threads, n // MIN_PIECE_BYTES))
    assert all(start % PAGE_BYTES == 0 for start, _ in parts)


def test_a_parallel_fill_reads_the_pieces_side_by_side_and_raises_a_pieces_error(tmp_path):
    """Real threads and real ``preadv``s: the pieces of a 5 MiB chunk land at their offsets (the file's bytes, read
    from an offset inside it); a failing piece's error reaches the caller after every other piece ended."""
    from concurrent.futures import ThreadPoolExecutor

    from dwdp_worker.checkpoint.device_staging import ParallelFill

    g = torch.Generator().manual_seed(1)
    save_file({"big": torch.randint(0, 255, (6 << 20,), generator=g, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))
    with SafetensorsIndex(tmp_path) as idx, ThreadPoolExecutor(3) as pool:
        e = idx.entries["big"]
        calls = []

        def fill(done, n, buffer):
            import threading

            calls.append((done, n, threading.get_ident()))
            idx._pread_into(e, done, n, buffer)

        buffer = torch.zeros(5 << 20, dtype=torch.uint8)
        ParallelFill(fill, pool, 4)(12345, buffer.numel(), buffer)
        assert len(calls) == 4 and len({t for _, _, t in calls}) >= 2  # the caller's piece + the pool's
        assert idx.bytes_read == buffer.numel()  # each byte counted once, from 4 threads
        assert torch.equal(buffer, idx.get("big")[12345:12345 + buffer.numel()])
        ended = []

        def failing(done, n, buffer):
            if done >= 1 << 20:
                raise OSError("disk gone")
            hold(0.05, "a slow read")
            ended.append(done)

        with pytest.raises(OSError, match="disk gone"):
            ParallelFill(failing, pool, 4)(0, 4 << 20, buffer)
        assert ended == [0]  # the caller's own piece finished before the error was raised
