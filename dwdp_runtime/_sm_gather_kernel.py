"""The CuTe DSL kernel behind ``dwdp_runtime.sm_gather`` (imported only when sm_gather is chosen).

Kept apart because it imports ``nvidia-cutlass-dsl`` at module level and its annotations must be
real objects (no ``from __future__ import annotations``: CuTe DSL reads the types of the kernel's
arguments from them). See ``sm_gather.py`` for the descriptor format and the invariants.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


def build(threads: int, unroll: int, line_bytes: int):
    """Compile the launcher ``gather(desc, nrows, ctas, stream)``; returns (compiled, (Int32, Int64, cuda))."""
    chunk = threads * unroll
    gmem = cute.AddressSpace.gmem

    @cute.kernel
    def gather_kernel(desc: Int64, nrows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        table = cutlass.inttoptr(desc, gmem, Int64)
        first = table + Int64(bidx) * 3
        dst = first.load()
        src = (first + 1).load()
        n = (first + 2).load()
        for r in range(bidx, nrows, gdim):
            # the next row's descriptor is loaded before this row's data (rows are padded by gdim)
            nxt = table + Int64(r + gdim) * 3
            ndst = nxt.load()
            nsrc = (nxt + 1).load()
            nn = (nxt + 2).load()
            dbytes = dst * line_bytes
            sbytes = src * line_bytes
            if n == chunk:
                # full row: `unroll` independent 16-byte loads in flight per thread, then the stores
                vals = []
                for u in cutlass.range_constexpr(unroll):
                    p = cutlass.inttoptr(sbytes + Int64(tidx + u * threads) * line_bytes, gmem, Int32)
                    vals.append(p.load(alignment=16, count=4))
                for u in cutlass.range_constexpr(unroll):
                    q = cutlass.inttoptr(dbytes + Int64(tidx + u * threads) * line_bytes, gmem, Int32)
                    q.store(vals[u], alignment=16)
            else:
                for i in range(Int64(tidx), n, threads):
                    p = cutlass.inttoptr(sbytes + i * line_bytes, gmem, Int32)
                    q = cutlass.inttoptr(dbytes + i * line_bytes, gmem, Int32)
                    q.store(p.load(alignment=16, count=4), alignment=16)
            dst = ndst
            src = nsrc
            n = nn

    @cute.jit
    def gather(desc: Int64, nrows: Int32, ctas: Int32, stream: cuda.CUstream):
        gather_kernel(desc, nrows).launch(grid=[ctas, 1, 1], block=[threads, 1, 1], stream=stream)

    compiled = cute.compile(gather, Int64(0), Int32(0), Int32(1), cuda.CUstream(0))
    return compiled, (Int32, Int64, cuda)
