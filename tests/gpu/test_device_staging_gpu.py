"""Checkpoint reads into GPU memory through pinned double buffering (``checkpoint.device_staging``): ``get`` and
``read_rows`` into CUDA tensors equal the CPU ``pread`` bitwise, across chunk edges (a small chunk forces many
slot rotations) and on a stream other than the default one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture()
def index(tmp_path):
    from safetensors.torch import save_file

    from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex

    g = torch.Generator().manual_seed(0)
    save_file({"big": torch.randn(1000, 4099, generator=g).to(torch.bfloat16),
               "small": torch.randn(3, 5, generator=g)}, str(tmp_path / "model.safetensors"))
    with SafetensorsIndex(tmp_path) as idx:
        yield idx


@pytest.mark.parametrize("chunk", [None, 1 << 16])
def test_reads_into_gpu_memory_equal_the_cpu_read(index, chunk):
    from dwdp_worker.checkpoint.device_staging import DeviceStager

    if chunk is not None:
        index._stagers[torch.device("cuda:0")] = DeviceStager(torch.device("cuda:0"), chunk_bytes=chunk)
    for key in ("big", "small"):
        assert torch.equal(index.get(key, "cuda:0").cpu(), index.get(key))
    dst = torch.empty(500, 4099, dtype=torch.bfloat16, device="cuda:0")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        index.read_rows("big", 250, 750, dst)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), index.get("big")[250:750])


def test_many_reads_left_queued_are_complete_after_drain(index):
    """Reads return with their copies queued (the slots rotate across reads): after ``drain`` every destination
    holds its bytes, read from another stream than the one the copies ran on."""
    from dwdp_worker.checkpoint.device_staging import DeviceStager

    index._stagers[torch.device("cuda:0")] = DeviceStager(torch.device("cuda:0"), chunk_bytes=1 << 16)
    side = torch.cuda.Stream()
    dsts = []
    with torch.cuda.stream(side):
        for i in range(40):
            key, rows = ("small", (0, 3)) if i % 3 == 0 else ("big", (i, i + 200))
            dst = torch.empty(rows[1] - rows[0], *index.entries[key].shape[1:], dtype=index.entries[key].dtype,
                              device="cuda:0")
            index.read_rows(key, *rows, dst)
            dsts.append((key, rows, dst))
    index.drain()
    for key, (a, b), dst in dsts:  # the default stream: ordered only by the drain
        assert torch.equal(dst.cpu(), index.get(key)[a:b]), (key, a, b)
