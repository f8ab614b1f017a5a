"""sm_gather: copying the copy plan with SM threads (16-byte lines from a descriptor list).

An opt-in transfer mode (``transfer="sm_gather"``): one CuTe DSL kernel (``nvidia-cutlass-dsl``)
per layer copies every ``(dst, src, nbytes)`` entry of the layer's copy plan, instead of one
``cuMemcpyAsync`` per entry. Why it is opt-in and not the default: an SM copy competes with compute
for SMs and HBM bandwidth. HARDWARE.md measured an SM copy reading over NVLink slowing a concurrent
GEMM by +203 % on H200 (copy engines: +9–11 %); the numbers for THIS kernel on one H200 are in
docs/GPU.md. It only pays where compute fully covers the copy and SMs are idle, or where a plan has
very many small entries (one launch per layer instead of ~7 µs of driver work per entry).

Descriptor format (what the kernel consumes, one row per piece of the copy plan):
  ``int64[n, 3] = (dst_line, src_line, num_lines)`` with ``line = address // 16``; every address and
  size must be a multiple of 16 bytes (a 128-bit vector load/store per thread — the widest
  per-thread access Hopper has). Misaligned plans are refused at setup (``ValueError`` naming the
  offending address and ``copy_engine``), never mid-forward.
  ``compile`` splits every entry into rows of at most ``CHUNK_LINES`` (= THREADS × UNROLL = 2048
  lines, 32 KiB) so that any plan — two 144 MiB entries or 144 slices of 2 MiB — spreads evenly
  over the CTAs, and appends ``ctas`` zero rows so the kernel can prefetch row ``r + gridDim``
  without a bounds check.

Kernel (one launch per layer on the copy stream, grid = ``ctas`` CTAs × THREADS threads):
  CTA ``b`` walks rows ``b, b + ctas, b + 2·ctas, …``; while it copies row ``r`` it has already
  issued the loads of row ``r + ctas``'s descriptor (so descriptor latency overlaps the data).
  A full row: each thread issues UNROLL independent 16-byte loads (``ld.global.v4.b32``) before its
  UNROLL stores — 32 KiB in flight per CTA, enough memory-level parallelism for HBM/NVLink latency
  with few CTAs. A short row (tail of an entry) runs a plain strided 16-byte loop.
  The grid is a fixed number of CTAs (``ctas``, default ``DEFAULT_CTAS``; env
  ``DWDP_SM_GATHER_CTAS``): it bounds how many SMs the copy can take from the GEMM running beside
  it; the measured choice is in docs/GPU.md.

Invariants:
  * setup (``SmGather()`` + ``compile``) does everything that costs: imports CuTe DSL (~6 s), JIT-
    compiles the kernel ONCE per process (cached at module level; 0.1–0.5 s on sm_90), builds the
    descriptor tensor on the device, and prebuilds the launch arguments;
  * ``launch`` allocates nothing (host or device) beyond the ctypes argument packing the runtime
    reuses, never synchronizes, and enqueues one kernel on the given stream;
  * rows never overlap in dst (the copy plan's invariant), so CTAs need no coordination;
  * where CuTe DSL cannot be imported or compiled, ``SmGather()`` raises ``SmGatherUnavailable``
    with the reason — at setup (``CudaStreams`` construction), never mid-forward.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

LINE_BYTES = 16
THREADS = 256  # threads per CTA
UNROLL = 8  # independent 16-byte loads in flight per thread on a full row
CHUNK_LINES = THREADS * UNROLL  # 2048 lines = 32 KiB per descriptor row (at most)
DEFAULT_CTAS = 32  # see docs/GPU.md for the sweep behind this choice
MAX_CTAS = 4096


class SmGatherUnavailable(RuntimeError):
    """``transfer='sm_gather'`` cannot run here (raised at setup)."""


def build_descriptors(copies: Sequence[tuple[int, int, int]], line_bytes: int = LINE_BYTES) -> list[tuple[int, int, int]]:
    """``(dst_line, src_line, num_lines)`` rows for ``(dst, src, nbytes)`` copies; raises on misalignment."""
    rows = []
    for dst, src, n in copies:
        for what, value in (("dst", dst), ("src", src), ("nbytes", n)):
            if value % line_bytes:
                raise ValueError(f"sm_gather needs {line_bytes}-byte aligned copies: {what}=0x{value:x} "
                                 f"is not (use transfer 'copy_engine')")
        if n:
            rows.append((dst // line_bytes, src // line_bytes, n // line_bytes))
    return rows


def total_lines(rows: Sequence[tuple[int, int, int]]) -> int:
    return sum(r[2] for r in rows)


def split_rows(rows: Sequence[tuple[int, int, int]], chunk: int = CHUNK_LINES) -> list[tuple[int, int, int]]:
    """Rows of at most ``chunk`` lines covering exactly the same lines (order kept)."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    out = []
    for d, s, n in rows:
        for off in range(0, n, chunk):
            out.append((d + off, s + off, min(chunk, n - off)))
    return out


def kernel_rows(copies: Sequence[tuple[int, int, int]], ctas: int, chunk: int = CHUNK_LINES) -> list[tuple[int, int, int]]:
    """What the kernel reads: aligned, split rows followed by one zero row per CTA (prefetch padding).

    ``ctas=0`` means one CTA per row (grid = number of rows): the padding is then as long as the rows.
    """
    rows = split_rows(build_descriptors(copies), chunk)
    return rows + [(0, 0, 0)] * (ctas or len(rows))


def default_ctas() -> int:
    raw = os.environ.get("DWDP_SM_GATHER_CTAS", "")
    if not raw:
        return DEFAULT_CTAS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"DWDP_SM_GATHER_CTAS={raw!r}: expected a positive integer") from None
    return value


# -- the kernel (built lazily: CuTe DSL is an optional dependency) --------------------------------
_lock = threading.Lock()
_cache: dict[str, Any] = {}


def _import_cute():
    """The kernel module (imports CuTe DSL and cuda-python at its top; ~6 s the first time)."""
    from . import _sm_gather_kernel

    return _sm_gather_kernel


def compiled_kernel():
    """(compiled launcher, (Int32, Int64, cuda)) — JIT-compiled once per process."""
    with _lock:
        if "kernel" not in _cache:
            _cache["kernel"] = _import_cute().build(THREADS, UNROLL, LINE_BYTES)
        return _cache["kernel"]


@dataclass
class GatherPlan:
    """One layer's copies, ready to launch: descriptor tensor on the device + launch arguments."""

    desc: Any  # torch.int64 [rows + ctas, 3] on the device (kept alive here)
    nrows: int  # real rows (without the padding)
    lines: int
    ctas: int
    _args: dict = field(default_factory=dict)  # raw stream handle -> prebuilt execution arguments


class SmGather:
    """The CuTe DSL gather kernel; refuses at construction (setup) with the reason when unavailable."""

    def __init__(self, *, device=None, ctas: int | None = None):
        ctas = default_ctas() if ctas is None else int(ctas)
        if not 0 <= ctas <= MAX_CTAS:
            raise ValueError(f"sm_gather ctas={ctas}: expected 1..{MAX_CTAS}, or 0 for one CTA per row")
        self.ctas = ctas
        try:
            _import_cute()
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
            raise SmGatherUnavailable(
                f"transfer 'sm_gather' is unavailable: nvidia-cutlass-dsl cannot be imported "
                f"({type(exc).__name__}: {exc}; pip install nvidia-cutlass-dsl). Use transfer 'copy_engine' "
                f"(default) or 'batched'; sm_gather is an opt-in SM copy that taxes concurrent compute "
                f"(docs/GPU.md)") from exc
        import torch

        if not torch.cuda.is_available():
            raise SmGatherUnavailable("transfer 'sm_gather' needs a visible CUDA GPU; use transfer 'copy_engine'")
        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        try:
            with torch.cuda.device(self.device):
                self._compiled, (self._Int32, self._Int64, self._cuda) = compiled_kernel()
                self._executor = self._compiled.to(self.device.index)
        except Exception as exc:  # noqa: BLE001 - a JIT failure is a setup refusal, with its text
            raise SmGatherUnavailable(
                f"transfer 'sm_gather' is unavailable: the CuTe DSL gather kernel failed to compile or load "
                f"({type(exc).__name__}: {str(exc)[:400]}). Use transfer 'copy_engine' (default)") from exc
        self._fast = hasattr(self._executor, "generate_execution_args") and hasattr(
            self._executor, "run_compiled_program")

    def compile(self, triples: Sequence[tuple[int, int, int]]) -> GatherPlan:
        """Setup: descriptor tensor on the device (the only allocation) for one layer's copies."""
        rows = kernel_rows(triples, self.ctas)  # raises ValueError on misalignment (use copy_engine)
        nrows = len(rows) // 2 if self.ctas == 0 else len(rows) - self.ctas
        desc = self._torch.tensor(rows, dtype=self._torch.int64, device=self.device).reshape(-1, 3)
        return GatherPlan(desc=desc, nrows=nrows, lines=sum(r[2] for r in rows), ctas=self.ctas or max(nrows, 1))

    def _launch_args(self, plan: GatherPlan, raw_stream: int):
        args = plan._args.get(raw_stream)
        if args is None:
            call = (self._Int64(plan.desc.data_ptr()), self._Int32(plan.nrows), self._Int32(plan.ctas),
                    self._cuda.CUstream(raw_stream))
            if self._fast:
                exe_args, adapted = self._executor.generate_execution_args(*call)
                args = (exe_args, adapted, call)
            else:
                args = (None, None, call)
            plan._args[raw_stream] = args
        return args

    def launch(self, plan: GatherPlan, stream) -> None:
        """Enqueue the layer's gather on ``stream`` (a torch stream or a raw handle); no sync, no allocation."""
        if plan.nrows == 0:
            return
        raw = stream if isinstance(stream, int) else stream.cuda_stream
        exe_args, _adapted, call = self._launch_args(plan, raw)
        if exe_args is not None:
            self._executor.run_compiled_program(exe_args)
        else:
            self._executor(*call)
