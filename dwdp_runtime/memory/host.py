"""Host memory backend: the CPU twin of the CUDA virtual-memory API, on memfd + mmap.

  create  → ``os.memfd_create`` + ``ftruncate``           (a physical allocation)
  export  → a dup of the memfd (sent to peers with SCM_RIGHTS, ``fdpass``)
  reserve → ``mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
  map     → ``mmap(va, n, PROT_NONE, MAP_SHARED|MAP_FIXED, fd, 0)`` — whole allocation only, like
            cuMemMap on H200 (partial maps refused here too, so CPU tests catch layout bugs)
  set_access → ``mprotect`` over the whole reservation (read-only for peer views)
  unmap   → re-reserve the range (``MAP_FIXED`` anonymous PROT_NONE): the VA stays reserved
  as_tensor → ``torch.frombuffer`` over the mapped address: zero-copy, checked by data_ptr().

This is what CI and the CPU demo run; DWDP's ordering logic is identical on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

from .base import Allocation, BackendUnavailable, MemoryBackend, choose_granularity, nbytes_of

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class HostMemory(MemoryBackend):
    name = "host"
    handle_transport = "fd"

    def __init__(self, *, granularity: int | None = None):
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("host backend needs Linux memfd_create (Python on Linux >= 3.17)")
        self._granularity = choose_granularity(granularity, mmap.PAGESIZE, what="the OS page size")
        self._libc = _libc()
        self.stats = {"create": 0, "reserve": 0, "map": 0}
        self.live = {"allocations": 0, "reservations": 0}  # leak accounting (tests, metrics)

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def _mmap(self, va: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
        out = self._libc.mmap(va, nbytes, prot, flags, fd, 0)
        if out in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap({nbytes} bytes) failed: {os.strerror(err)}")
        return out

    def create(self, nbytes: int) -> Allocation:
        self._check_size(nbytes)
        fd = os.memfd_create("dwdp", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.stats["create"] += 1
        self.live["allocations"] += 1
        return Allocation(nbytes=nbytes, native=fd)

    def export(self, alloc: Allocation) -> int:
        return os.dup(alloc.native)

    def import_(self, shareable, nbytes: int) -> Allocation:
        if not isinstance(shareable, int):
            raise TypeError("host backend imports file descriptors")
        size = os.fstat(shareable).st_size
        if size != nbytes:
            os.close(shareable)
            raise ValueError(f"imported allocation has {size} bytes, expected {nbytes}")
        self.live["allocations"] += 1
        return Allocation(nbytes=nbytes, native=shareable, imported=True)

    def reserve(self, nbytes: int) -> int:
        self._check_size(nbytes)
        self.stats["reserve"] += 1
        self.live["reservations"] += 1
        return self._mmap(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)

    def map(self, va: int, alloc: Allocation) -> None:
        if alloc.released:
            raise ValueError("cannot map a released allocation")
        self.stats["map"] += 1
        self._mmap(va, alloc.nbytes, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, alloc.native)

    def set_access(self, va: int, nbytes: int, *, writable: bool = True) -> None:
        prot = _PROT_READ | (_PROT_WRITE if writable else 0)
        if self._libc.mprotect(va, nbytes, prot) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect failed: {os.strerror(err)}")

    def unmap(self, va: int, nbytes: int) -> None:
        self._mmap(va, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1)

    def free_reservation(self, va: int, nbytes: int) -> None:
        if self._libc.munmap(va, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap failed: {os.strerror(err)}")
        self.live["reservations"] -= 1

    def release(self, alloc: Allocation) -> None:
        if not alloc.released:
            alloc.released = True
            os.close(alloc.native)
            self.live["allocations"] -= 1

    def as_tensor(self, va: int, shape: tuple[int, ...], dtype):
        import torch

        nbytes = nbytes_of(shape, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = (ctypes.c_uint8 * nbytes).from_address(va)
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
        if t.data_ptr() != va:
            raise RuntimeError(f"tensor over 0x{va:x} is not zero-copy (data_ptr 0x{t.data_ptr():x})")
        return t
