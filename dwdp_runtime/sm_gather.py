"""sm_gather: copying the copy plan with SM threads (16-byte lines from a descriptor list).

An opt-in transfer mode (``transfer="sm_gather"``): one CuTe DSL kernel (``nvidia-cutlass-dsl``)
per layer copies every ``(dst, src, nbytes)`` entry of the layer's copy plan, instead of one
``cuMemcpyAsync`` per entry. Why it is opt-in and not the default: an SM copy takes SMs and HBM
bandwidth from the compute beside it. Measured on one H200 (docs/GPU.md, HBM→HBM): a concurrent
8192³ bf16 GEMM slowed by +15–24 % (16–132 CTAs) / +27 % (one CTA per row) at the same stream
priority, +7–19 % / −2 % with the GEMM on a higher-priority stream, where the driver's own
device-to-device copy cost +3–4 % / −4…−2 % (runs differ by up to ±7 points). docs/DRIVER_FACTS.md measured an
SM copy reading over NVLink at +203 % (copy engines: +9–11 %); the x2 run of THIS kernel is not made
yet. Where it wins: plans with many entries — one launch per layer (~4–7 µs host) instead of ~5 µs
of driver work per entry: with contention_opt's 144 slices per layer, 0.87–2.0 TB/s vs 0.21–0.48
TB/s for copy_engine on one GPU.

Descriptor format (what the kernel consumes, one row per piece of the copy plan):
  ``int64[n, 3] = (dst_line, src_line, num_lines)`` with ``line = address // 16``; every address and
  size must be a multiple of 16 bytes (a 128-bit vector load/store per thread — the widest
  per-thread access Hopper has). Misaligned plans are refused at setup (``ValueError`` naming the
  offending address and ``copy_engine``), never mid-forward.
  ``compile`` splits every entry into rows of at most ``CHUNK_LINES`` (= THREADS × UNROLL = 2048
  lines, 32 KiB) so that any plan — two 144 MiB entries or 144 slices of 2 MiB — spreads evenly
  over the CTAs, and appends one zero row per CTA so the kernel can prefetch row ``r + gridDim``
  without a bounds check.

Kernel (one launch per layer on the copy stream, THREADS = 256 threads per CTA):
  CTA ``b`` walks rows ``b, b + grid, b + 2·grid, …``; while it copies row ``r`` it has already
  issued the loads of row ``r + grid``'s descriptor (descriptor latency overlaps the data).
  A full row: each thread issues UNROLL = 8 independent 16-byte loads (``ld.global.v4.b32``) before
  its 8 stores — 32 KiB in flight per CTA. A short row (an entry's tail) runs a strided 16-byte loop.
  Grid (``ctas``, default ``DEFAULT_CTAS`` = 32; env ``DWDP_SM_GATHER_CTAS``):
    * ``ctas = N`` > 0: a persistent grid of N CTAs — bounds the SMs the copy can hold. Measured on
      one H200: 16 → 0.47 TB/s, 32 → 0.86–0.89 TB/s, 64 → 1.5 TB/s, 132 → 1.94–1.97 TB/s. 32 is the
      default: on NVLink (~390 GB/s per direction on H200) it has a > 2× margin while holding a
      quarter of the SMs; on ONE GPU it reaches only ~0.43 of copy_ (HBM needs ≥ 132 CTAs).
    * ``ctas = 0``: one CTA per row (grid = number of rows, short-lived CTAs). 2.0 TB/s on one
      H200 (= copy_), and with compute on a higher-priority stream the block scheduler favours the
      compute CTAs: GEMM tax −2 % (vs +10 % at 32 CTAs); with compute at the SAME priority +27 %.
      The recommended setting on one GPU and wherever compute runs on a higher-priority stream.

Invariants:
  * setup (``SmGather()`` + ``compile``) does everything that costs: imports CuTe DSL (2–4 s),
    JIT-compiles the kernel ONCE per process (cached at module level; 0.1–0.15 s on sm_90), builds
    the descriptor tensor on the device, and (first launch per stream) the launch arguments;
  * ``launch`` allocates no device memory, never synchronizes, and enqueues one kernel on the given
    stream (prebuilt ctypes arguments through the DSL executor; ~4–14 µs host);
  * rows never overlap in dst (the copy plan's invariant), so CTAs need no coordination;
  * where CuTe DSL cannot be imported or compiled, ``SmGather()`` raises ``SmGatherUnavailable``
    with the reason — at setup (``CudaStreams`` construction), never mid-forward.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from .contract import TuningEnv

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
    raw = os.environ.get(TuningEnv.SM_GATHER_CTAS, "")
    if not raw:
        return DEFAULT_CTAS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{TuningEnv.SM_GATHER_CTAS}={raw!r}: expected a positive integer") from None
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
    # raw stream handle -> prebuilt execution arguments: filled by ``SmGather.launch`` on the first
    # launch on a stream, reused after (a steady-state launch builds nothing)
    launch_args: dict[int, Any] = field(default_factory=dict, repr=False)


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
        return GatherPlan(desc=desc, nrows=nrows, lines=total_lines(rows), ctas=self.ctas or max(nrows, 1))

    def _build_args(self, plan: GatherPlan, raw_stream: int):
        call = (self._Int64(plan.desc.data_ptr()), self._Int32(plan.nrows), self._Int32(plan.ctas),
                self._cuda.CUstream(raw_stream))
        if self._fast:
            exe_args, adapted = self._executor.generate_execution_args(*call)
            return exe_args, adapted, call
        return None, None, call

    def launch(self, plan: GatherPlan, stream) -> None:
        """Enqueue the layer's gather on ``stream`` (a torch stream or a raw handle); no sync, no allocation."""
        if plan.nrows == 0:
            return
        raw = stream if isinstance(stream, int) else stream.cuda_stream
        args = plan.launch_args.get(raw)
        if args is None:
            args = plan.launch_args[raw] = self._build_args(plan, raw)
        exe_args, _adapted, call = args
        if exe_args is not None:
            self._executor.run_compiled_program(exe_args)
        else:
            self._executor(*call)
