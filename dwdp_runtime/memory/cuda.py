"""CUDA memory backend: the ``MemoryBackend`` interface on the CUDA driver's virtual-memory API.

  create  → ``cuMemCreate`` (pinned device memory on this GPU, ONE shareable handle type:
            cuda-bindings cannot express ``POSIX_FD|FABRIC`` together, docs/DRIVER_FACTS.md)
  export  → ``cuMemExportToShareableHandle``: an int fd (``posix_fd``, passed with ``fdpass``)
            or 64 bytes (``fabric``, exchanged through the rendezvous store)
  import_ → ``cuMemImportFromShareableHandle`` (the fd is closed here: the handle keeps the memory)
  reserve → ``cuMemAddressReserve`` aligned to the granularity (2 MiB on H200)
  map     → ``cuMemMap`` of the WHOLE handle (a partial map returns CUDA_ERROR_NOT_SUPPORTED on H200)
  set_access → ONE ``cuMemSetAccess`` per reservation, for this process's device only. For a peer
            view (memory physically on another GPU) access for the importing device is all NVLink
            reads need. Peer views ask for read-only access; a driver that refuses PROT_READ gets
            READWRITE instead (logged once): run time never writes a peer view either way.
  unmap   → ``cuMemUnmap`` after a device synchronize: the driver does not order unmapping after
            kernels in flight, and unmap only runs at setup/teardown, never in steady state.
  as_tensor → ``torch.as_tensor`` over a ``__cuda_array_interface__`` v3 object. bf16 (and every
            other dtype) is exposed as a same-width integer typestr (``<i2`` …) and re-viewed, since
            the interface has no bf16 typestr. ``data_ptr() == va`` is checked: a silent copy
            would defeat DWDP, so it raises instead.

Call order (docs/DRIVER_FACTS.md): torch creates the primary context first (``torch.cuda.set_device`` +
a 1-element tensor), then ``cuInit(0)``; driver calls use that current context.

Invariants: every handle is created with exactly one handle type; a fabric backend is probed at
construction (a fabric allocation must succeed), so no IMEX channel fails at start with a message
naming the fix, never mid-forward. Nothing here runs in steady state.

``import dwdp_runtime.memory.cuda`` works without cuda-python; constructing ``CudaMemory`` without
it raises ``BackendUnavailable`` saying ``pip install cuda-python``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .base import (HANDLE_TYPES, Allocation, BackendUnavailable, MemoryBackend, choose_granularity, element_size,
                   nbytes_of)

log = logging.getLogger(__name__)

FABRIC_HANDLE_BYTES = 64
_READONLY_FALLBACK_LOGGED = False


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""

    def __init__(self, what: str, code: Any, name: str, text: str):
        super().__init__(f"{what} failed: {name} ({text})")
        self.code, self.name = code, name


def load_driver():
    """``cuda.bindings.driver`` or a BackendUnavailable that says how to install it."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailable(
            f"the cuda memory backend needs cuda-python's driver bindings (pip install cuda-python): {exc}"
        ) from exc
    return driver


def check(driver, result, what: str):
    """Unpack a cuda-bindings result tuple ``(CUresult, *values)``; raise CudaError on failure."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(what, err, name, text)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def int_typestr(itemsize: int) -> str:
    """The ``__cuda_array_interface__`` typestr of an integer as wide as one element.

    Used for every dtype (bf16 has no typestr of its own): the tensor is re-viewed as the real
    dtype afterwards, which is free (same bytes, same strides).
    """
    table = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}
    try:
        return table[itemsize]
    except KeyError:
        raise TypeError(f"no zero-copy typestr for {itemsize}-byte elements (supported: 1, 2, 4, 8)") from None


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` (v3) owner of nothing: the mapping outlives the tensor."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, va: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (va, False), "strides": None,
            "version": 3,
        }


class CudaMemory(MemoryBackend):
    name = "cuda"

    def __init__(self, *, device=None, handle_type: str = "posix_fd", granularity: int | None = None):
        if handle_type not in HANDLE_TYPES:
            raise ValueError(f"handle_type {handle_type!r}: choose one of {', '.join(HANDLE_TYPES)}")
        driver = load_driver()
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable("the cuda memory backend needs a visible CUDA GPU (use backend 'host' on CPU)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaMemory needs a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self._driver, self._device = driver, dev
        self.handle_type = handle_type
        self.name = f"cuda/{handle_type}"
        self.handle_transport = "fd" if handle_type == "posix_fd" else "bytes"
        # Hardware reason: torch must create (and make current) the primary context before the
        # driver API is used, or the driver calls below run without a context (docs/DRIVER_FACTS.md).
        torch.cuda.set_device(dev)
        torch.empty(1, device=dev)
        check(driver, driver.cuInit(0), "cuInit")
        self._ctx = check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._cudev = check(driver, driver.cuDeviceGet(dev.index), "cuDeviceGet")
        attr = driver.CUdevice_attribute
        if not check(driver, driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._cudev), "cuDeviceGetAttribute"):
            raise BackendUnavailable(f"{dev} does not support CUDA virtual memory management (cuMemCreate/cuMemMap)")
        want = (attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED if handle_type == "posix_fd"
                else attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
        if not check(driver, driver.cuDeviceGetAttribute(want, self._cudev), "cuDeviceGetAttribute"):
            raise BackendUnavailable(f"{dev} does not support {handle_type} shareable handles")
        self._htype = (driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                       if handle_type == "posix_fd" else driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = dev.index
        self._prop.requestedHandleTypes = self._htype
        recommended = int(check(driver, driver.cuMemGetAllocationGranularity(
            self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self._granularity = choose_granularity(granularity, recommended,
                                               what="the driver's recommended granularity")
        self._access = {}
        for writable, flag in ((True, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
                               (False, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)):
            desc = driver.CUmemAccessDesc()
            desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = dev.index  # the importing device: enough for NVLink peer reads
            desc.flags = flag
            self._access[writable] = desc
        self._readonly_supported = True
        self._probed = False
        self.stats = {"create": 0, "reserve": 0, "map": 0, "set_access": 0, "import": 0}
        if handle_type == "fabric":
            self.probe()

    # -- helpers -------------------------------------------------------------------------------
    def _call(self, result, what: str):
        return check(self._driver, result, what)

    def _current(self) -> None:
        # Setup-time calls may come from a thread torch never touched: make the primary context current.
        self._call(self._driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self):
        return self._device

    def probe(self) -> None:
        """Create, export and release one granule: proves this handle type works here (fabric: IMEX)."""
        if self._probed:
            return
        try:
            alloc = self.create(self._granularity)
        except CudaError as exc:
            if self.handle_type == "fabric":
                hint = ("no IMEX channel is granted to this process (CUDA_ERROR_NOT_PERMITTED): fabric handles "
                        "need nvidia-imex running and /dev/nvidia-caps-imex-channels/channel0 visible, as on "
                        "GB200/NVL72. On one node (HGX H100/H200/B200) use backend 'posix_fd' (or 'auto')"
                        if exc.name == "CUDA_ERROR_NOT_PERMITTED" else "use backend 'posix_fd' (or 'auto')")
                raise BackendUnavailable(f"fabric handles are unavailable on {self._device}: {exc}; {hint}") from exc
            raise BackendUnavailable(f"{self.handle_type} allocations fail on {self._device}: {exc}") from exc
        try:
            shareable = self.export(alloc)
            if isinstance(shareable, int):
                os.close(shareable)
        finally:
            self.release(alloc)
        self.stats["create"] -= 1
        self._probed = True

    # -- interface -------------------------------------------------------------------------------
    def create(self, nbytes: int) -> Allocation:
        self._check_size(nbytes)
        self._current()
        handle = self._call(self._driver.cuMemCreate(nbytes, self._prop, 0), f"cuMemCreate({nbytes} bytes)")
        self.stats["create"] += 1
        return Allocation(nbytes=nbytes, native=handle)

    def export(self, alloc: Allocation) -> int | bytes:
        out = self._call(self._driver.cuMemExportToShareableHandle(alloc.native, self._htype, 0),
                         f"cuMemExportToShareableHandle({self.handle_type})")
        if self.handle_type == "posix_fd":
            return int(out)
        data = bytes(out.data)
        if len(data) != FABRIC_HANDLE_BYTES:
            raise RuntimeError(f"fabric handle has {len(data)} bytes, expected {FABRIC_HANDLE_BYTES}")
        return data

    def import_(self, shareable, nbytes: int) -> Allocation:
        self._check_size(nbytes)
        self._current()
        if self.handle_type == "posix_fd":
            if not isinstance(shareable, int):
                raise TypeError("the posix_fd backend imports file descriptors")
            try:
                handle = self._call(self._driver.cuMemImportFromShareableHandle(shareable, self._htype),
                                    "cuMemImportFromShareableHandle(posix_fd)")
            finally:
                os.close(shareable)  # the imported handle keeps the memory alive; the fd is not needed
        else:
            if not isinstance(shareable, (bytes, bytearray)) or len(shareable) != FABRIC_HANDLE_BYTES:
                raise TypeError(f"the fabric backend imports {FABRIC_HANDLE_BYTES}-byte handles")
            fh = self._driver.CUmemFabricHandle()
            fh.data = bytes(shareable)
            handle = self._call(self._driver.cuMemImportFromShareableHandle(fh, self._htype),
                                "cuMemImportFromShareableHandle(fabric)")
        self.stats["import"] += 1
        # The size is checked by map(): a whole-handle map with the wrong size fails in the driver.
        return Allocation(nbytes=nbytes, native=handle, imported=True)

    def reserve(self, nbytes: int) -> int:
        self._check_size(nbytes)
        self._current()
        ptr = self._call(self._driver.cuMemAddressReserve(nbytes, self._granularity, 0, 0),
                         f"cuMemAddressReserve({nbytes} bytes)")
        self.stats["reserve"] += 1
        return int(ptr)

    def map(self, va: int, alloc: Allocation) -> None:
        if alloc.released:
            raise ValueError("cannot map a released allocation")
        self._current()
        self._call(self._driver.cuMemMap(va, alloc.nbytes, 0, alloc.native, 0),
                   f"cuMemMap(0x{va:x}, {alloc.nbytes} bytes; whole handle)")
        self.stats["map"] += 1

    def set_access(self, va: int, nbytes: int, *, writable: bool = True) -> None:
        global _READONLY_FALLBACK_LOGGED
        self._current()
        self.stats["set_access"] += 1
        if not writable and self._readonly_supported:
            try:
                self._call(self._driver.cuMemSetAccess(va, nbytes, [self._access[False]], 1),
                           "cuMemSetAccess(read-only)")
                return
            except CudaError as exc:
                self._readonly_supported = False
                if not _READONLY_FALLBACK_LOGGED:
                    _READONLY_FALLBACK_LOGGED = True
                    log.info("read-only peer mappings refused (%s); peer views are mapped read-write "
                             "(DWDP never writes them)", exc.name)
        self._call(self._driver.cuMemSetAccess(va, nbytes, [self._access[True]], 1), "cuMemSetAccess")

    def unmap(self, va: int, nbytes: int) -> None:
        import torch

        # Hardware reason: cuMemUnmap is not stream-ordered; kernels or copies still touching the
        # range would fault. Unmap runs at setup/teardown only, so a device sync here is free.
        torch.cuda.synchronize(self._device)
        self._current()
        self._call(self._driver.cuMemUnmap(va, nbytes), f"cuMemUnmap(0x{va:x}, {nbytes})")

    def free_reservation(self, va: int, nbytes: int) -> None:
        self._current()
        self._call(self._driver.cuMemAddressFree(va, nbytes), f"cuMemAddressFree(0x{va:x}, {nbytes})")

    def release(self, alloc: Allocation) -> None:
        if not alloc.released:
            alloc.released = True
            self._current()
            self._call(self._driver.cuMemRelease(alloc.native), "cuMemRelease")

    def as_tensor(self, va: int, shape: tuple[int, ...], dtype):
        import torch

        if nbytes_of(shape, dtype) == 0:
            return torch.empty(shape, dtype=dtype, device=self._device)
        raw = torch.as_tensor(_CudaArray(va, tuple(int(d) for d in shape), int_typestr(element_size(dtype))),
                              device=self._device)
        t = raw.view(dtype)
        # No silent copy fallback: a copied tensor would look right and cost the memory DWDP saves.
        if t.data_ptr() != va or t.device != self._device:
            raise RuntimeError(f"tensor over 0x{va:x} is not zero-copy (data_ptr 0x{t.data_ptr():x} on {t.device})")
        return t
