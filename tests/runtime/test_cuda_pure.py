"""CPU-only checks of the CUDA backend's pure parts and of its lazy imports (no GPU, no cuda-python)."""

from __future__ import annotations

import ctypes
import sys

import pytest


@pytest.fixture
def no_cuda_python(monkeypatch):
    """Make ``from cuda.bindings import driver`` fail even where cuda-python is installed."""
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)


GPU_MODULES = ("dwdp_runtime.memory.cuda", "dwdp_runtime.cuda_streams", "dwdp_runtime.sm_gather")


def test_modules_import_without_cuda_python(no_cuda_python):
    import importlib

    for mod in GPU_MODULES:
        assert importlib.reload(importlib.import_module(mod)).__name__ == mod  # ImportError here = not lazy
    assert sys.modules["cuda.bindings.driver"] is None  # nothing replaced the blocked driver module


def test_gpu_modules_import_nothing_heavy():
    """A fresh interpreter imports the GPU modules without loading torch, cuda-python or CuTe DSL."""
    import subprocess

    code = ("import sys; " + "; ".join(f"import {m}" for m in GPU_MODULES) + "; "
            "print(sorted(m for m in ('torch', 'cuda', 'cutlass') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cuda_memory_without_cuda_python_says_how_to_install(no_cuda_python):
    from dwdp_runtime.memory.base import BackendUnavailable
    from dwdp_runtime.memory.cuda import CudaMemory

    with pytest.raises(BackendUnavailable, match="pip install cuda-python"):
        CudaMemory(device="cuda:0")


def test_cuda_streams_without_cuda_is_refused(no_cuda_python):
    from dwdp_runtime.cuda_streams import CudaStreams

    with pytest.raises(ValueError, match="copy_engine"):
        CudaStreams(transfer="nvlink_magic")
    with pytest.raises(RuntimeError, match="cuda-python|CUDA GPU"):
        CudaStreams(transfer="copy_engine")


def test_bad_handle_type_is_refused():
    from dwdp_runtime.memory.cuda import CudaMemory

    with pytest.raises(ValueError, match="posix_fd"):
        CudaMemory(handle_type="ipc")


def test_select_cuda_backend_without_gpu_fails_at_start():
    import torch

    from dwdp_runtime.memory import BackendUnavailable, select_backend

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    for name in ("cuda", "posix_fd", "fabric"):
        with pytest.raises(BackendUnavailable, match="host"):
            select_backend(name)


def test_int_typestr_covers_every_torch_width():
    import torch

    from dwdp_runtime.memory.cuda import _CudaArray, int_typestr

    for dtype, want in ((torch.bfloat16, "<i2"), (torch.float16, "<i2"), (torch.float32, "<i4"),
                        (torch.uint8, "|u1"), (torch.float64, "<i8"), (torch.int32, "<i4")):
        assert int_typestr(torch.empty((), dtype=dtype).element_size()) == want
    with pytest.raises(TypeError, match="16-byte"):
        int_typestr(16)
    cai = _CudaArray(0x7F0000000000, (4, 3), "<i2").__cuda_array_interface__
    assert cai == {"shape": (4, 3), "typestr": "<i2", "data": (0x7F0000000000, False), "strides": None,
                   "version": 3}


def test_batch_arrays_pack_the_plan_verbatim():
    from dwdp_runtime.cuda_streams import batch_arrays

    copies = [(0x7F00_0000_0000 + i * (2 << 20), 0x7E00_0000_0000 + i * 4096, (2 << 20) - i) for i in range(5)]
    dsts, srcs, sizes = batch_arrays(copies)
    assert list(dsts) == [d for d, _, _ in copies]
    assert list(srcs) == [s for _, s, _ in copies]
    assert list(sizes) == [n for _, _, n in copies]
    assert ctypes.sizeof(dsts) == 8 * 5 and ctypes.sizeof(sizes) == ctypes.sizeof(ctypes.c_size_t) * 5


def test_sm_gather_descriptors_and_alignment():
    from dwdp_runtime.sm_gather import build_descriptors, total_lines

    rows = build_descriptors([(0x1000, 0x2000, 64), (0x3000, 0x4010, 16), (0x5000, 0x6000, 0)])
    assert rows == [(0x100, 0x200, 4), (0x300, 0x401, 1)]
    assert total_lines(rows) == 5
    with pytest.raises(ValueError, match="src=0x2008"):
        build_descriptors([(0x1000, 0x2008, 16)])
    with pytest.raises(ValueError, match="nbytes"):
        build_descriptors([(0x1000, 0x2000, 8)])


def test_sm_gather_refuses_with_the_reason(monkeypatch):
    """Where CuTe DSL cannot be imported, construction (setup) refuses and names the fallback."""
    from dwdp_runtime import sm_gather
    from dwdp_runtime.sm_gather import SmGather, SmGatherUnavailable

    for name in ("cutlass", "cutlass.cute", "dwdp_runtime._sm_gather_kernel"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(sm_gather, "_cache", {})
    with pytest.raises(SmGatherUnavailable, match="nvidia-cutlass-dsl cannot be imported.*copy_engine"):
        SmGather()
    with pytest.raises(ValueError, match="ctas"):
        SmGather(ctas=-1)


def test_sm_gather_rows_split_and_pad():
    from dwdp_runtime.sm_gather import CHUNK_LINES, kernel_rows, split_rows

    rows = split_rows([(100, 7, 5), (1000, 9000, 2 * CHUNK_LINES + 3)], chunk=CHUNK_LINES)
    assert rows == [(100, 7, 5), (1000, 9000, CHUNK_LINES), (1000 + CHUNK_LINES, 9000 + CHUNK_LINES, CHUNK_LINES),
                    (1000 + 2 * CHUNK_LINES, 9000 + 2 * CHUNK_LINES, 3)]
    covered = {(d + i, s + i) for d, s, n in rows for i in range(n)}
    assert len(covered) == 5 + 2 * CHUNK_LINES + 3
    assert split_rows([(0, 0, 10)], chunk=4) == [(0, 0, 4), (4, 4, 4), (8, 8, 2)]
    k = kernel_rows([(0x1000, 0x2000, 64), (0x3000, 0x4000, 0)], ctas=3)
    assert k == [(0x100, 0x200, 4), (0, 0, 0), (0, 0, 0), (0, 0, 0)]  # 3 zero rows: prefetch padding
    # ctas=0: one CTA per row, so the padding is as long as the rows
    assert kernel_rows([(0, 0x40, 16 * (CHUNK_LINES + 1))], ctas=0) == [
        (0, 4, CHUNK_LINES), (CHUNK_LINES, 4 + CHUNK_LINES, 1), (0, 0, 0), (0, 0, 0)]
    with pytest.raises(ValueError, match="copy_engine"):
        kernel_rows([(0x1008, 0x2000, 16)], ctas=1)


def test_sm_gather_ctas_from_env(monkeypatch):
    from dwdp_runtime.sm_gather import DEFAULT_CTAS, default_ctas

    monkeypatch.delenv("DWDP_SM_GATHER_CTAS", raising=False)
    assert default_ctas() == DEFAULT_CTAS
    monkeypatch.setenv("DWDP_SM_GATHER_CTAS", "64")
    assert default_ctas() == 64
    monkeypatch.setenv("DWDP_SM_GATHER_CTAS", "lots")
    with pytest.raises(ValueError, match="DWDP_SM_GATHER_CTAS"):
        default_ctas()