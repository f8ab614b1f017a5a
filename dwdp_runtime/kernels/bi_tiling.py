"""The tiling of a batch-invariant GEMM and the arithmetic every ``bi_matmul`` kernel shares.

Invariant (``bi_matmul`` docstring): the tiling is a function of ``(N, K, dtype)`` only (``config_for``), never of
M, and every kernel — persistent, tiled, TMA — computes a tile with the same ``_dot`` steps in ascending K order
and walks tiles in the same GROUP_M swizzle (``_swizzled_tile``). The kernels live in ``bi_matmul`` (pointer
loads) and ``bi_matmul_tma`` (copy-engine loads); both import this module, neither imports the other's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import triton
import triton.language as tl

from .support import interpreting


class Kernel(StrEnum):
    """Which kernel computes a tiling (module docstring): the same arithmetic, three ways to schedule it."""
    PERSISTENT = "persistent"   # _persistent_mm: at most NUM_PROGRAMS programs walking the tiles
    TILED = "tiled"             # _tiled_mm: one tile per program, pointer loads
    TMA = "tma"                 # _tma_mm: one tile per program, TMA loads (_tiled_mm where TMA cannot)


#: persistent programs when the device count is unknown (the interpreter): H200's SM count
DEFAULT_PROGRAMS = 132
#: 16-bit tiling up to WIDE_N columns (routers of 65-128 experts: on an H100, 2026-12-07, bench/bi_tiles.py, within
#: 5 % of the best TMA tiling at 16K and faster at 4K): 128×128 wgmma tiles, 64-wide K steps as every other GEMM
#: of ours, 8 warps
TILE_16BIT = (128, 128, 64, 8, 3)
#: 16-bit tiling above WIDE_N columns (every projection): 128×256 tiles, 4 stages, one tile per program, the
#: operands through TMA (``_tma_mm``) where the rows are 16-byte multiples, else ``_tiled_mm`` (bench/bi_tiles.py,
#: H100 2026-12-07: the best or within 2 % of it on 16 of the 20 projection and 256-expert router shapes × row counts;
#: 5-25 % behind a 128×128 or 256×128 TMA tiling on the other four)
TILE_16BIT_WIDE = (128, 256, 64, 8, 4, Kernel.TMA)
#: TMA's rule for every stride but the last, and for the base address: a multiple of 16 bytes
TMA_ALIGN = 16
#: above this many columns the wide tiling (a 256-expert router: 0.98× cuBLAS at 16K rows with it, 0.26× with
#: the persistent 128×128 one, H100 2026-12-07)
WIDE_N = 128
#: the wide tiling's K step under Triton's interpreter: its tensors hold at most 2^20 elements, and the
#: interpreter's broadcast product (``_dot``) of a 128×256 tile at K step 64 holds 2^21 (the CPU tests check the
#: structure of the invariant, which does not depend on the K step)
INTERP_WIDE_BLOCK_K = 32
#: narrow-N tiling (routers: N = #experts ≤ 64) so a 16-bit router does not waste 128 - N columns
TILE_16BIT_NARROW = (128, 64, 64, 4, 3)
#: fp32 (ieee FMA dot, no tensor cores): small tiles keep the register file from spilling
TILE_FP32 = (64, 64, 32, 4, 2)
NARROW_N = 64
GROUP_M = 8
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Tile:
    """A fixed tiling: the invariant says it may depend on ``(N, K, dtype)`` only."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    kernel: Kernel = Kernel.PERSISTENT


def config_for(n: int, k: int, dtype: torch.dtype) -> Tile:
    """The tiling of an ``[·, K] @ [K, N]`` GEMM of ``dtype`` — a function of N, K and dtype, never of M."""
    # every K uses the same step; K (with N) decides only whether TMA can read the rows — still M-free
    if dtype == torch.float32:
        return Tile(*TILE_FP32)
    if n <= NARROW_N:
        return Tile(*TILE_16BIT_NARROW)
    if n <= WIDE_N:
        return Tile(*TILE_16BIT)
    wide = Tile(*TILE_16BIT_WIDE)
    esize = dtype.itemsize
    kernel = wide.kernel if (k * esize) % TMA_ALIGN == 0 and (n * esize) % TMA_ALIGN == 0 else Kernel.TILED
    return Tile(wide.block_m, wide.block_n, INTERP_WIDE_BLOCK_K if interpreting() else wide.block_k,
                wide.num_warps, wide.num_stages, kernel)


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr, IEEE: tl.constexpr):
    if INTERP:
        # the interpreter's tl.dot is numpy's BLAS, whose result for an element depends on its position in the
        # tile (edge micro-kernels) and which multiplies bf16 as raw bits: a broadcast product summed along K
        # in fp32 is exact per product and the same for every position, like a GPU MMA's per-element order
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _swizzled_tile(tile, num_m, num_n, GROUP: tl.constexpr):
    """Row and column block of output tile ``tile`` in GROUP-swizzled order (L2 reuse of the weight columns)."""
    per_group = GROUP * num_n
    first_m = (tile // per_group) * GROUP
    group_m = tl.minimum(num_m - first_m, GROUP)
    return first_m + ((tile % per_group) % group_m), (tile % per_group) // group_m
