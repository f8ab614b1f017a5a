"""Tile configs of the grouped GEMMs: a measured default table, a warm-up tuner, and the cache between them.

Key of a choice (``ShapeKey``): the GEMM (``gate_up`` / ``down``), its N and K, the expert count, top-k,
the dtype, and the *load bucket* — average rows per expert ``T·k / E`` rounded up to a power of two
(the quantity that decides how full a row block is). The key is pure host arithmetic on shapes: choosing
a config never touches the device.

Life cycle:
  * ``config_for(key)`` → the tuned choice if ``tune`` ran for that key in this process, else the default
    table's entry (``default_config``). A forward therefore never tunes, never compiles more than the
    configs it was told to use, and never synchronises.
  * ``tune(key, run)`` times every candidate (``candidates``) with ``triton.testing.do_bench`` on a
    caller-supplied closure and caches the fastest; the engine/bench call it at warm-up only.

Batch invariance (see ``grouped_gemm``): a row's value depends on its GEMM's BLOCK_K pipeline only if
the MMA instruction shape changed with it; to be safe every candidate of one (GEMM, N, K) keeps the same
BLOCK_K, so a token's output is bitwise the same whichever load bucket its batch falls in. BLOCK_M must
also be the same for both GEMMs of one forward (they share one routing plan): the tuner picks BLOCK_M
on GEMM 1 and tunes GEMM 2's N-tiling under it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

#: fixed reduction step per GEMM (see the module docstring: one BLOCK_K per weight shape)
BLOCK_K = 64
#: rows per expert from which the weight tiles go through TMA descriptors by default: measured on an H200
#: at 1024 (Qwen3-MoE, 16K tokens) and 2048 (DeepSeek-V3 shape, 16K) rows per expert, 8 % faster per GEMM
#: than pointer loads; below that not measured, so the pointer path stays
TMA_MIN_LOAD = 1024
#: the same for GEMM 2 (``down``): measured at the DeepSeek-V3 expert shape, 4K tokens (512 rows per expert):
#: TMA weight tiles 9 % faster than the best pointer-load config (1.57 vs 1.71 ms), while GEMM 1 there was
#: 2 % faster on pointer loads (noise level: kept at ``TMA_MIN_LOAD``); H200, 2026-12-01, docs/KERNELS.md
TMA_MIN_LOAD_DOWN = 512
#: the largest load bucket (rows per expert) on the 64-row / 4-warp tiles; above it the 128-row / 8-warp ones
#: (``default_config``). At 256 rows the large tiles win: ``bench/moe_block.py --tiles`` on an H100 (2026-12-07,
#: whole block with the router, graphed): Qwen3 at 4K tokens 0.846 against 1.079 ms (1.09 against 1.39 × the
#: two-GEMM floor), the DeepSeek-V3 shape over 64 experts at 2K 3.60 against 4.62 ms; 128 rows not measured
MID_TILE_MAX_LOAD = 128
#: row blocks per L2 swizzle group: 8 blocks of one expert's rows sweep its B columns while they stay in L2
GROUP_M = 8


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int = BLOCK_K
    group_m: int = GROUP_M
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False     # weight tiles through the copy engine (TMA descriptor) where the view allows it


@dataclass(frozen=True)
class ShapeKey:
    gemm: str          # "gate_up" | "down"
    n: int             # output columns (I for gate_up after the gate, H for down)
    k: int             # reduction length
    num_experts: int
    top_k: int
    dtype: str
    load: int          # power-of-two bucket of T·k / E


def load_bucket(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Average rows per expert, rounded up to a power of two (at least 1)."""
    avg = max(1, -(-num_tokens * top_k // max(1, num_experts)))
    return 1 << (avg - 1).bit_length()


def default_config(key: ShapeKey) -> GemmConfig:
    """The config a forward uses when ``tune`` has not run for ``key`` — the tuner's winners on an H200
    (docs/KERNELS.md, 2026-12-01). Loads above 256 rows per expert (4K–32K tokens, Qwen3-MoE and the
    DeepSeek-V3 expert shape): the same winner everywhere; stages 3 vs 4 and swizzle 8 vs 16 were within
    2 % (noise), other tilings 5–25 % slower. At 1K tokens (64–128 rows per expert) GEMM 1 preferred
    64 columns (3–9 % faster than 128). From 256 rows the large tiling (``MID_TILE_MAX_LOAD``: re-measured
    2026-12-07, 21–22 % faster there).

    Row block as full as the average expert allows: 16/32 rows for decode-size loads, 64 up to
    ``MID_TILE_MAX_LOAD`` rows per expert, 128 beyond (a 128-row tile = two 64-row wgmma warpgroups, padding waste under one block per
    expert). Large loads: GEMM 1 takes 128 columns of gate *and* of up (two 128×128 fp32 accumulators, as
    much as 8 warps hold without spilling); GEMM 2's single accumulator affords 256 columns. Four pipeline
    stages of 64-wide K steps: (128 + 256) × 64 × 2 B = 48 KiB a stage, 192 KiB of Hopper's 227 KiB.
    From ``TMA_MIN_LOAD`` rows per expert (GEMM 2: ``TMA_MIN_LOAD_DOWN``) the weight tiles come through TMA
    descriptors (same operands, same MMA sequence: bitwise the pointer-load result, tested). Re-measured at
    32K tokens (4,096 rows per expert), both shapes: TMA won both GEMMs, 3–10 % over pointer loads."""
    if key.load <= 32:
        return GemmConfig(block_m=16 if key.load <= 16 else 32, block_n=64, num_warps=4, num_stages=4)
    if key.load <= MID_TILE_MAX_LOAD:
        return GemmConfig(block_m=64, block_n=64 if key.gemm == "gate_up" else 128, num_warps=4, num_stages=4)
    tma_from = TMA_MIN_LOAD if key.gemm == "gate_up" else TMA_MIN_LOAD_DOWN
    return GemmConfig(block_m=128, block_n=128 if key.gemm == "gate_up" else 256, num_warps=8, num_stages=4,
                      tma=key.load >= tma_from)


def _row_blocks(load: int) -> tuple[int, ...]:
    """BLOCK_M choices for a load bucket: blocks no emptier than half on average."""
    if load <= 16:
        return (16,)
    if load <= 32:
        return (16, 32)
    if load <= 64:
        return (32, 64)
    if load <= 128:
        return (64,)
    return (64, 128)


def candidates(key: ShapeKey, block_m: int | None = None, wide: bool = False) -> list[GemmConfig]:
    """Configs the tuner tries for ``key`` (BLOCK_K fixed; BLOCK_M fixed when given). About 8 per GEMM
    (each is a compile at warm-up): column blocks 64/128 (and 256 for ``down``, whose single accumulator
    leaves room), 4 or 8 warps, 4 stages where a stage fits 48 KiB, else 3. ``wide`` also tries 3 stages,
    swizzle groups of 16 row blocks and weight tiles through TMA descriptors (the bench's sweep)."""
    out = []
    for m in ((block_m,) if block_m else _row_blocks(key.load)):
        for n in ((64, 128) if key.gemm == "gate_up" else (64, 128, 256)):
            b_tiles = 2 if key.gemm == "gate_up" else 1
            stage_bytes = (m + b_tiles * n) * BLOCK_K * 2
            for warps in (4, 8):
                if m * n * b_tiles >= 128 * 256 and warps == 4:
                    continue  # 128×256 fp32 accumulators spill at 4 warps
                deepest = 4 if stage_bytes <= 48 * 1024 else 3
                for stages in ((3, deepest) if wide and deepest > 3 else (deepest,)):
                    for group in ((GROUP_M, 2 * GROUP_M) if wide else (GROUP_M,)):
                        out.append(GemmConfig(block_m=m, block_n=n, num_warps=warps, num_stages=stages,
                                              group_m=group))
                if wide and m >= 64:
                    out.append(GemmConfig(block_m=m, block_n=n, num_warps=warps, num_stages=deepest, tma=True))
    return out


_TUNED: dict[ShapeKey, GemmConfig] = {}


def config_for(key: ShapeKey) -> GemmConfig:
    return _TUNED.get(key) or default_config(key)


def is_tuned(key: ShapeKey) -> bool:
    return key in _TUNED


def remember(key: ShapeKey, cfg: GemmConfig) -> None:
    _TUNED[key] = cfg


def forget_all() -> None:
    _TUNED.clear()


def tune(key: ShapeKey, run: Callable[[GemmConfig], None], *, block_m: int | None = None, wide: bool = False,
         warmup_ms: int = 5, rep_ms: int = 20) -> tuple[GemmConfig, dict[GemmConfig, float]]:
    """Time ``run(cfg)`` for every candidate (median ms, CUDA events) and cache the fastest for ``key``.

    A candidate that fails to compile or launch (e.g. too much shared memory) is skipped."""
    import triton.testing

    times: dict[GemmConfig, float] = {}
    for cfg in candidates(key, block_m, wide):
        try:
            times[cfg] = float(triton.testing.do_bench(lambda: run(cfg), warmup=warmup_ms, rep=rep_ms,
                                                       return_mode="median"))
        except Exception:  # noqa: BLE001 - an infeasible config (out of resources) is not a choice
            continue
    if not times:
        best = default_config(key)
    else:
        best = min(times, key=times.get)
    remember(key, best)
    return best, times


def with_block_m(cfg: GemmConfig, block_m: int) -> GemmConfig:
    return replace(cfg, block_m=block_m)
