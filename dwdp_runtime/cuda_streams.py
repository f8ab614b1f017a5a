"""CudaStreams: the ``Streams`` interface on real CUDA streams and events.

  compute stream = the caller's current torch stream (looked up at every call, so a model that
                   runs under ``torch.cuda.stream(s)`` — e.g. a higher-priority stream — is obeyed);
  copy stream    = one dedicated stream at the LOWEST priority: when an SM-driven copy (same-GPU
                   D2D, ``sm_gather``) competes with compute for SMs, the scheduler serves compute
                   first (docs/DRIVER_FACTS.md: a higher-priority compute stream cut copy_'s GEMM tax from
                   +76 % to +18 % on one GPU).
  events         = ``torch.cuda.Event`` (no timing, so recording is cheap), recorded once on the
                   copy stream at creation: a new event counts as signalled, as the interface asks.

Transfer modes, all driven by the copy plan compiled once at setup (``compile``):
  * ``copy_engine`` (default): one ``cuMemcpyAsync`` per plan entry on the copy stream. Over
    NVLink the driver drives these with the copy engines (~390 GB/s, compute tax < 10 %). On ONE
    GPU a device-to-device copy is executed by SM kernels, not a copy engine (docs/DRIVER_FACTS.md).
  * ``batched``: one ``cuMemcpyBatchAsync`` per layer (CUDA 13 ABI, no failIdx, resolved with
    ``cuGetProcAddress``) with the pointer/size arrays prebuilt as ctypes arrays at setup, so the
    steady-state call converts nothing. It is refused on the legacy default stream
    (CUDA_ERROR_INVALID_VALUE) — the copy stream is never that — and cannot be graph-captured.
    Attributes: ``srcAccessOrder = STREAM`` (sources are read in stream order, after the waits),
    ``PREFER_OVERLAP_WITH_COMPUTE``.
  * ``sm_gather``: an SM kernel gathering 16-byte lines (see ``dwdp_runtime.sm_gather``); opt-in,
    refused at construction when its kernel is unavailable.

Invariants: ``enqueue_copies`` / ``record_*`` / ``wait_*`` allocate no device memory and never
synchronize the device; only ``synchronize()`` does (counted in ``stats['synchronize']``), which the
weight manager calls only after a schedule restart, and setup/teardown.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

from .contract import DEFAULT_TRANSFER, TRANSFER_MODES, Transfer
from .streams import CopyStreamError, CopyTriple, Streams

BATCH_ABI_VERSION = 13000  # cuMemcpyBatchAsync's CUDA 13 signature (no failIdx argument)

# CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
#                             CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream)
_BATCH_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


@dataclass(frozen=True)
class CompiledCopies:
    """One layer's copies in the form its transfer mode submits fastest (built once at setup)."""

    mode: str
    triples: tuple[CopyTriple, ...]  # (dst, src, nbytes), kept for benchmarks and debugging
    nbytes: int
    args: Any  # mode-specific, see CudaStreams.compile


def batch_arrays(copies: Sequence[CopyTriple]):
    """ctypes arrays ``(dsts, srcs, sizes)`` for cuMemcpyBatchAsync (pure: testable on CPU)."""
    n = len(copies)
    dsts = (ctypes.c_uint64 * n)(*(int(d) for d, _, _ in copies))
    srcs = (ctypes.c_uint64 * n)(*(int(s) for _, s, _ in copies))
    sizes = (ctypes.c_size_t * n)(*(int(b) for _, _, b in copies))
    return dsts, srcs, sizes


class CudaStreams(Streams):
    def __init__(self, *, device=None, transfer: str = DEFAULT_TRANSFER):
        if transfer not in TRANSFER_MODES:
            raise ValueError(f"transfer {transfer!r}: choose one of {', '.join(TRANSFER_MODES)}")
        import torch

        from .memory.cuda import check, load_driver

        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreams needs a visible CUDA GPU")
        self._torch = torch
        self._driver = driver = load_driver()
        self._check = check
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.transfer = transfer
        self.capturable = transfer != Transfer.BATCHED  # cuMemcpyBatchAsync cannot be captured (docstring)
        self._gather = None
        if transfer == Transfer.SM_GATHER:
            from .sm_gather import SmGather

            self._gather = SmGather(device=self.device)  # raises at setup when the kernel is unavailable
        # CUDA priorities run 0 (lowest, the default) to negative (higher): the copy stream takes the
        # lowest so compute kernels win SM contention (see docstring).
        self.copy_stream = torch.cuda.Stream(device=self.device, priority=0)
        self._cu_stream = driver.CUstream(self.copy_stream.cuda_stream)
        self._success = driver.CUresult.CUDA_SUCCESS
        self._memcpy = driver.cuMemcpyAsync
        self._batch_fn = None
        self._batch_attr = None
        if transfer == Transfer.BATCHED:
            self._batch_fn, self._batch_attr = self._resolve_batch()
        self._raw_stream = self._copy_raw = None
        self._event_record = self._stream_wait = None
        self._resolve_event_calls()
        self.stats = {"copy_bytes": 0, "copy_batches": 0, "copy_calls": 0, "synchronize": 0, "wait_s": 0.0}
        self._closed = False

    def _proc(self, name: str, proto):
        driver = self._driver
        pfn, _status = self._check(driver, driver.cuGetProcAddress(
            name.encode(), BATCH_ABI_VERSION, driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT),
            f"cuGetProcAddress({name})")
        return proto(int(pfn)) if int(pfn) else None

    def _resolve_event_calls(self) -> None:
        """Raw event record/wait: the bind path costs ~1 µs instead of ~8 µs through torch's wrappers.

        Host reason: ``wait_and_bind`` runs once per MoE layer on the critical host path; torch's
        ``current_stream()`` builds a Python Stream object per call. The raw path reads the caller's
        current stream handle (``torch._C._cuda_getCurrentRawStream``) and calls the driver directly.
        Falls back to torch's API where either piece is missing (same semantics, slower).
        """
        raw = getattr(self._torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            return
        vp = ctypes.c_void_p
        record = self._proc("cuEventRecord", ctypes.CFUNCTYPE(ctypes.c_int, vp, vp))
        wait = self._proc("cuStreamWaitEvent", ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_uint))
        if record is None or wait is None:
            return
        self._raw_stream, self._event_record, self._stream_wait = raw, record, wait
        self._copy_raw = self.copy_stream.cuda_stream
        self._dev_index = self.device.index

    def _raw_fail(self, rc: int, what: str):
        self._check(self._driver, (self._driver.CUresult(rc),), what)

    def _resolve_batch(self):
        driver = self._driver
        pfn, status = self._check(driver, driver.cuGetProcAddress(
            b"cuMemcpyBatchAsync", BATCH_ABI_VERSION, driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT),
            "cuGetProcAddress(cuMemcpyBatchAsync)")
        if not int(pfn):
            raise RuntimeError(f"transfer 'batched' needs cuMemcpyBatchAsync with the CUDA 13 signature; this "
                               f"driver has none ({status}); use transfer 'copy_engine'")
        attr = driver.CUmemcpyAttributes()
        # Sources are peers' local handles read after the copy stream's waits: stream order.
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        return _BATCH_PROTO(int(pfn)), attr

    # -- events ----------------------------------------------------------------------------------
    def new_event(self):
        ev = self._torch.cuda.Event()
        # Recorded once through torch (which creates the CUevent lazily on first record): a wait
        # on a new event never stalls, and ``ev.cuda_event`` is a valid handle for the raw path.
        ev.record(self.copy_stream)
        return ev

    def record_compute(self, event) -> None:
        if self._raw_stream is not None:
            rc = self._event_record(event.cuda_event, self._raw_stream(self._dev_index))
            if rc:
                self._raw_fail(rc, "cuEventRecord on the compute stream")
            return
        event.record(self._torch.cuda.current_stream(self.device))

    def wait_compute(self, event) -> None:
        # A stream-side wait: the host returns at once, the compute stream waits on the device.
        if self._raw_stream is not None:
            rc = self._stream_wait(self._raw_stream(self._dev_index), event.cuda_event, 0)
            if rc:
                self._raw_fail(rc, "cuStreamWaitEvent on the compute stream")
            return
        self._torch.cuda.current_stream(self.device).wait_event(event)

    def record_copy(self, event) -> None:
        if self._raw_stream is not None:
            rc = self._event_record(event.cuda_event, self._copy_raw)
            if rc:
                self._raw_fail(rc, "cuEventRecord on the copy stream")
            return
        event.record(self.copy_stream)

    def wait_copy(self, event) -> None:
        if self._raw_stream is not None:
            rc = self._stream_wait(self._copy_raw, event.cuda_event, 0)
            if rc:
                self._raw_fail(rc, "cuStreamWaitEvent on the copy stream")
            return
        self.copy_stream.wait_event(event)

    # -- copies ------------------------------------------------------------------------------------
    def compile(self, copies: Sequence[CopyTriple]) -> CompiledCopies:
        triples = tuple((int(d), int(s), int(n)) for d, s, n in copies)
        nbytes = sum(n for _, _, n in triples)
        driver = self._driver
        if self.transfer == Transfer.COPY_ENGINE:
            args = tuple((driver.CUdeviceptr(d), driver.CUdeviceptr(s), n) for d, s, n in triples)
        elif self.transfer == Transfer.BATCHED:
            dsts, srcs, sizes = batch_arrays(triples)
            idxs = (ctypes.c_size_t * 1)(0)
            args = (dsts, srcs, sizes, len(triples), idxs)
        else:
            args = self._gather.compile(triples)
        return CompiledCopies(self.transfer, triples, nbytes, args)

    def enqueue_copies(self, compiled: CompiledCopies) -> None:
        if self._closed:
            raise CopyStreamError("copy stream is closed")
        if not compiled.triples:
            return
        if compiled.mode == Transfer.COPY_ENGINE:
            memcpy, stream, ok = self._memcpy, self._cu_stream, self._success
            for dst, src, n in compiled.args:
                err = memcpy(dst, src, n, stream)[0]
                if err != ok:
                    self._check(self._driver, (err,), f"cuMemcpyAsync({n} bytes) on the copy stream")
            self.stats["copy_calls"] += len(compiled.args)
        elif compiled.mode == Transfer.BATCHED:
            dsts, srcs, sizes, count, idxs = compiled.args
            rc = self._batch_fn(ctypes.addressof(dsts), ctypes.addressof(srcs), ctypes.addressof(sizes), count,
                                self._batch_attr.getPtr(), ctypes.addressof(idxs), 1,
                                self.copy_stream.cuda_stream)
            if rc:
                self._check(self._driver, (self._driver.CUresult(rc),),
                            f"cuMemcpyBatchAsync({count} copies) on the copy stream")
            self.stats["copy_calls"] += 1
        else:
            self._gather.launch(compiled.args, self.copy_stream)
            self.stats["copy_calls"] += 1
        self.stats["copy_bytes"] += compiled.nbytes
        self.stats["copy_batches"] += 1

    def synchronize(self) -> None:
        """Device-wide: only after a schedule restart and at setup/teardown (counted)."""
        self.stats["synchronize"] += 1
        self._torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.copy_stream.synchronize()
            except Exception:  # noqa: BLE001 - teardown must not raise over the original error
                pass
