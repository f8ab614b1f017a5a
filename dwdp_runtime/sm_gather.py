"""sm_gather: copying the copy plan with SM threads (16-byte lines from a descriptor list).

Status: the descriptor format is built and tested here; the CuTe DSL kernel (``nvidia-cutlass-dsl``)
is NOT shipped in this version, so ``transfer="sm_gather"`` fails at setup (``CudaStreams``
construction) with ``SmGatherUnavailable`` — never mid-forward. Reason it is opt-in at all: an SM
copy reading over NVLink slowed a concurrent GEMM by +203 % on H200 (copy engines: +9–11 %), see
HARDWARE.md; it only pays where compute fully covers the copy and SMs are idle.

Descriptor format (what a kernel consumes, one row per contiguous run of the copy plan):
  ``int64[n, 3] = (dst_line, src_line, num_lines)`` with ``line = address // 16``; every address and
  size must be a multiple of 16 bytes (a 128-bit vector load/store per thread — the widest
  per-thread access Hopper has). The total line count sets the grid; a thread block walks rows.
Invariants: rows never overlap in dst; the plan's 2 MiB slices keep rows ≤ 131072 lines each.
"""

from __future__ import annotations

from typing import Sequence

LINE_BYTES = 16


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


class SmGather:
    """Placeholder for the CuTe DSL gather kernel: refuses at construction with the reason."""

    def __init__(self, *, device=None):
        try:
            import cutlass  # noqa: F401  (nvidia-cutlass-dsl)
            have = True
        except ImportError:
            have = False
        detail = ("nvidia-cutlass-dsl is importable, but " if have else
                  "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl) and ")
        raise SmGatherUnavailable(
            f"transfer 'sm_gather' is unavailable: {detail}the CuTe DSL gather kernel is not built in this "
            f"version of dwdp_runtime. Use transfer 'copy_engine' (default) or 'batched'; sm_gather is an "
            f"opt-in that costs concurrent compute about +200 % over NVLink (docs/GPU.md)")

    def compile(self, triples):  # pragma: no cover - unreachable until the kernel ships
        raise SmGatherUnavailable("sm_gather kernel not built")

    def launch(self, compiled, stream):  # pragma: no cover
        raise SmGatherUnavailable("sm_gather kernel not built")
