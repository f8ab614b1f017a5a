"""A safetensors checkpoint read with ``pread``: the tensor index of a model directory and byte-range reads.

Invariant: nothing of a file stays mapped or resident in this process after a read — bytes go from the
page cache straight into the caller's tensor (a transport handle for the local experts), or into GPU memory
through two reused pinned chunks (``device_staging``), so a rank never holds a weight twice. Only the documented file format is used (see ``SafetensorsIndex``).

``reopened()`` opens the files again after ``close`` for a later read through the same index (the reload of
experts a lost rank held, issue #30), refusing a file that changed since its header was read; ``bytes_read``
counts every byte read, so a caller can say exactly what a reload read.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import threading
from dataclasses import dataclass
from typing import Any

from .device_staging import DeviceStager


class CheckpointError(ValueError):
    """The model directory is missing, incomplete or inconsistent with its config."""


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


@dataclass(frozen=True)
class _Entry:
    path: pathlib.Path
    dtype: Any
    shape: tuple[int, ...]
    start: int          # absolute byte offset of the tensor in the file
    nbytes: int


class SafetensorsIndex:
    """key → (file, dtype, shape, byte range) over a checkpoint's safetensors files; reads with ``pread``.

    Why not ``safe_open`` (mmap): a tensor read through a mapping leaves its file pages resident in this
    process (they count in RSS as long as the file stays mapped), so reading the local experts through mmap
    holds them twice. ``pread`` into the destination tensor moves the bytes from the page cache straight into
    the transport handle: nothing else stays resident. The format is the documented one: an 8-byte
    little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}}``
    relative to the end of the header, then the data. Row slices of a row-major tensor are one byte range.
    """

    def __init__(self, model_dir):
        self.dir = pathlib.Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({self.dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files")
        self.entries: dict[str, _Entry] = {}
        self._fds: dict[pathlib.Path, int] = {}
        self._files: dict[pathlib.Path, tuple[int, int]] = {}  # (size, mtime ns) when the header was read
        self._stagers: dict[Any, DeviceStager] = {}  # pinned staging per CUDA device (reads into GPU memory)
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        try:
            for f in files:
                self._read_header(f)
        except BaseException:
            self.close()
            raise

    def _read_header(self, path: pathlib.Path) -> None:
        import os
        import struct

        import torch

        fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(fd)
        size = st.st_size
        self._files[path] = (size, st.st_mtime_ns)
        raw = os.pread(fd, 8, 0)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(os.pread(fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
        base = 8 + n
        for key, info in header.items():
            if key == "__metadata__":
                continue
            name = _ST_DTYPES.get(info["dtype"])
            if name is None or not hasattr(torch, name):
                raise CheckpointError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            if base + end > size:
                raise CheckpointError(f"{path}: tensor {key} extends past the end of the file (truncated download?)")
            self.entries[key] = _Entry(path, getattr(torch, name), tuple(info["shape"]), base + begin, end - begin)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key].shape

    def _pread_into(self, e: _Entry, offset: int, nbytes: int, dst) -> None:
        """Read ``nbytes`` at ``e.start + offset`` into the contiguous CPU tensor ``dst`` (same byte size)."""
        import os

        buf = dst.reshape(-1).view(__import__("torch").uint8).numpy()
        mv = memoryview(buf)
        fd, pos, done = self._fds[e.path], e.start + offset, 0
        while done < nbytes:
            got = os.preadv(fd, [mv[done:]], pos + done)
            if got <= 0:
                raise CheckpointError(f"{e.path}: short read at byte {pos + done}")
            done += got
        with self._count_lock:  # pieces of one chunk are read by several threads (device_staging)
            self.bytes_read += nbytes

    def read_rows(self, key: str, begin: int, end: int, dst) -> None:
        """``dst.copy_(tensor[begin:end])`` without materialising the tensor: a direct read when ``dst`` is a
        contiguous CPU tensor of the checkpoint dtype, else through one staging buffer of that size."""
        import torch

        e = self.entries[key]
        rows = e.shape[0] if e.shape else 1
        if not 0 <= begin <= end <= rows:
            raise CheckpointError(f"{key}: rows [{begin}, {end}) outside [0, {rows})")
        row_bytes = e.nbytes // max(rows, 1)
        shape = (end - begin, *e.shape[1:]) if e.shape else ()
        if tuple(dst.shape) != shape:
            raise CheckpointError(f"{key}[{begin}:{end}]: shape {shape} does not fit {tuple(dst.shape)}")
        if dst.dtype == e.dtype and dst.is_contiguous() and dst.device.type in ("cpu", "cuda"):
            self._read_direct(e, begin * row_bytes, (end - begin) * row_bytes, dst)
            return
        staging = torch.empty(shape, dtype=e.dtype)
        self._pread_into(e, begin * row_bytes, (end - begin) * row_bytes, staging)
        dst.copy_(staging)

    def get(self, key: str, device=None):
        """The whole tensor, on ``device`` (default CPU)."""
        import torch

        e = self.entries[key]
        out = torch.empty(e.shape, dtype=e.dtype, device=device)
        self._read_direct(e, 0, e.nbytes, out)
        return out

    def _read_direct(self, e: _Entry, offset: int, nbytes: int, dst) -> None:
        """``nbytes`` at ``e.start + offset`` into the contiguous tensor ``dst`` of that size: ``pread`` straight
        into a CPU one; into a CUDA one through pinned double buffering (``device_staging``)."""
        if dst.device.type != "cuda":
            self._pread_into(e, offset, nbytes, dst)
            return
        stager = self._stagers.get(dst.device)
        if stager is None:
            stager = self._stagers[dst.device] = DeviceStager(dst.device)
        stager.read(lambda done, n, buffer: self._pread_into(e, offset + done, n, buffer), nbytes, dst)

    @contextlib.contextmanager
    def reopened(self):
        """The files open again for the block (after ``close``); yields the index. Raises ``CheckpointError`` when
        a file is gone or changed (size or mtime) since its header was read: its offsets would be wrong."""
        import os

        if self._fds:
            yield self
            return
        try:
            for path, (size, mtime) in self._files.items():
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot reopen the checkpoint ({exc})") from None
                self._fds[path] = fd
                st = os.fstat(fd)
                if (st.st_size, st.st_mtime_ns) != (size, mtime):
                    raise CheckpointError(f"{path}: the checkpoint changed since it was loaded (size {size} → "
                                          f"{st.st_size}, or modified): its tensors' offsets no longer hold")
            yield self
        finally:
            self.close()

    def drain(self) -> None:
        """Wait for every read into GPU memory still being copied (``device_staging``: reads return with their
        copies queued on the stream that was current; ``close`` drains)."""
        for stager in self._stagers.values():
            stager.drain()

    def staging_totals(self) -> tuple[int, float]:
        """(bytes, seconds) of the reads into GPU memory so far: the time inside the stagers' reads and drains."""
        return (sum(s.bytes_staged for s in self._stagers.values()),
                sum(s.seconds for s in self._stagers.values()))

    def close(self) -> None:
        import os

        for stager in self._stagers.values():
            stager.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._stagers.clear()  # the pinned chunks go with the files (a reopened index pins them again)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CheckpointError", "SafetensorsIndex"]
