"""The memory-backend interface: physical allocations, virtual reservations, mappings, tensors.

One small interface, three backends with the same semantics (``host``, ``cuda`` with ``posix_fd``
or ``fabric`` handles). It mirrors the CUDA virtual-memory API because that is what DWDP needs:

  create(n) → Allocation        physical memory of n bytes (n a multiple of ``granularity``)
  export(a) → int fd | bytes    a shareable handle (fd: pass with ``fdpass``; bytes: via the store)
  import_(h, n) → Allocation    a peer's allocation, by its shareable handle
  reserve(n) → va               a range of virtual addresses with nothing mapped (no access)
  map(va, a)                    map a WHOLE allocation at va (partial mapping is not supported by
                                the driver: cuMemMap of part of a handle → CUDA_ERROR_NOT_SUPPORTED)
  set_access(va, n, writable)   one call over a whole reservation after all its mappings
  as_tensor(va, shape, dtype)   a torch tensor over va WITHOUT copying (checked: data_ptr() == va)
  unmap(va, n) / free_reservation(va, n) / release(a)

Teardown order: unmap every mapping, free the reservation, release allocations. An allocation
stays alive while any process still maps it (importers release before owners).

Shared by both backends (one definition each): ``_check_size`` (every create/reserve/import size
is a positive multiple of the granularity), ``choose_granularity`` (the backend's minimum — the OS
page, the driver's recommended granularity — or a requested multiple of it), ``nbytes_of``
(numel × itemsize; also the manager's per-expert bytes).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence


# CUDA shareable-handle types, also accepted as backend names (``select_backend("posix_fd")``)
HANDLE_TYPES: tuple[str, ...] = ("posix_fd", "fabric")


class BackendUnavailable(RuntimeError):
    """The requested memory backend cannot run on this machine (raised at start, never mid-forward)."""


def element_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype (``torch.dtype.itemsize``; no torch import here)."""
    return int(dtype.itemsize)


def nbytes_of(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``: numel × itemsize."""
    return math.prod(int(d) for d in shape) * element_size(dtype)


def choose_granularity(requested: int | None, minimum: int, *, what: str) -> int:
    """The allocation granularity: ``minimum`` (the OS page, the driver's recommended granularity)
    or a requested multiple of it (tests use small ones; larger ones trade memory for fewer maps)."""
    if not requested:  # None (or 0): the minimum
        return minimum
    if requested < 0 or requested % minimum:
        raise ValueError(f"granularity={requested} must be a positive multiple of {what} {minimum}")
    return requested


@dataclass(eq=False)
class Allocation:
    """A physical allocation: owned (created here) or imported from a peer."""

    nbytes: int
    native: Any  # backend object: memfd fd (host) or CUmemGenericAllocationHandle (cuda)
    imported: bool = False
    released: bool = field(default=False, repr=False)


class MemoryBackend(ABC):
    """See the module docstring. Implementations: ``HostMemory``, ``CudaMemory``."""

    name: str = "abstract"
    #: "fd" — export() returns an int file descriptor (send it with fdpass);
    #: "bytes" — export() returns bytes (exchange them through the rendezvous store).
    handle_transport: str = "fd"

    @property
    @abstractmethod
    def granularity(self) -> int: ...

    @property
    @abstractmethod
    def device(self) -> "Any":
        """The torch.device tensors of this backend live on."""

    def _check_size(self, nbytes: int) -> None:
        """Every create/reserve/import size is a positive multiple of the granularity."""
        if nbytes <= 0 or nbytes % self.granularity:
            raise ValueError(f"size {nbytes} must be a positive multiple of the granularity {self.granularity}")

    @abstractmethod
    def create(self, nbytes: int) -> Allocation: ...

    @abstractmethod
    def export(self, alloc: Allocation) -> int | bytes: ...

    @abstractmethod
    def import_(self, shareable: int | bytes, nbytes: int) -> Allocation:
        """Import a peer's allocation. An fd passed in is consumed (closed) by this call."""

    @abstractmethod
    def reserve(self, nbytes: int) -> int: ...

    @abstractmethod
    def map(self, va: int, alloc: Allocation) -> None: ...

    @abstractmethod
    def set_access(self, va: int, nbytes: int, *, writable: bool = True) -> None: ...

    @abstractmethod
    def unmap(self, va: int, nbytes: int) -> None: ...

    @abstractmethod
    def free_reservation(self, va: int, nbytes: int) -> None: ...

    @abstractmethod
    def release(self, alloc: Allocation) -> None: ...

    @abstractmethod
    def as_tensor(self, va: int, shape: tuple[int, ...], dtype: "Any"):
        """A tensor over ``va`` without copying; raises if the framework would copy."""

    def close(self) -> None:  # pragma: no cover - optional
        pass
