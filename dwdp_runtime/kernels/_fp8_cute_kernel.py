"""CuTe DSL kernel behind ``fp8_cute``: the warp-specialised block-scaled FP8 grouped GEMM for sm_90.

Imported only by ``fp8_cute`` when the CuTe path is chosen (``nvidia-cutlass-dsl`` at module level; no
``from __future__ import annotations``: CuTe DSL reads the argument types from the annotations).
Structure adapted from CUTLASS's CuTe DSL example ``hopper/dense_gemm_fp8_2xacc.py`` (BSD-3-Clause,
NVIDIA) — the persistent, warp-specialised FP8 GEMM with a promoted accumulator — with three changes:
grouped rows (each 128-row block of A belongs to one expert, read from ``block_expert``; idle blocks
skipped by producer and consumers alike), B indexed by that expert, and the promotion multiplied by the
128×128 block scales: ``acc += part · (s_a[row, kb] · s_b[e, nb, kb])`` once per 128-deep K step.

Why this shape on the hardware (H200, sm_90a):
  * one producer warp issues the TMA loads of A and B into an ``ab_stage``-deep mbarrier ring (as many
    stages as the 227 KiB of shared memory hold beside the epilogue buffers); it needs few registers
    (``LOAD_REGISTERS``), the two math warpgroups take the rest (``MMA_REGISTERS``);
  * two math warpgroups of 64 rows each share one 128 × BLOCK_N tile; each K step issues four
    ``wgmma m64nNk32`` into a scratch accumulator, waits for them, and promotes into the fp32 accumulator.
    A warpgroup's own promotion still waits for its MMA (the product needs the scale), but the other
    warpgroup's MMA runs on the tensor cores meanwhile, and the producer keeps the ring full — the overlap
    Triton's software pipelining does not give on sm_90; the step's scales are loaded one step ahead;
  * a tile's first MMA (and its first scales) is issued before the previous tile's epilogue, so the tensor cores
    work through it while both math warpgroups convert and store, and the tile starts without the L2 round trip
    of its scales: 9 % off both GEMMs on H200 (Qwen3-30B 16K 1.195-1.214 against 1.314-1.318 ms, DeepSeek-V3
    9.996-10.029 against 10.98-11.00 ms, alternated runs). Where no live tile follows, a stand-in MMA on the stale
    stage keeps one MMA in flight on every path, its result never read: a wgmma issued on one branch only makes
    ptxas wait for it where the branches join (C7517, which the compile test refuses);
  * clusters of two CTAs along N (``cluster_n``) share their row block's A tile by TMA multicast;
  * ``tile_n = 256`` (the plain GEMMs' default, ``fp8_cute.PLAIN_CONFIG``) loads two 128-column B tiles per stage
    and runs them through the one scratch accumulator into two promoted ones — the fused gate_up's mainloop with
    adjacent columns: a tile reads its A stage once per 256 columns and pays one epilogue per 256 columns
    (GEMM 2 5-9 % faster at DeepSeek-V3's N = 7168 on H200); a wider MMA (n256) would need a 128-register scratch
    beside 128 promoted registers, more than a math thread has;
  * the epilogue goes through shared memory and TMA stores of 128 × 32 sub-tiles (the example's), one store buffer
    per sub-tile of the tile (``EPI_SUBTILE_N``): the math threads write every sub-tile, then one proxy fence and
    one barrier later the store warp issues all their TMA stores as one bulk group, which drains during the next
    tile's mainloop — the next epilogue's only wait is for that group to have read its buffers. Two barriers a
    tile instead of two per sub-tile, and no wait inside a tile: Qwen3-30B's fused gate_up 2 % faster on H200
    (0.865-0.880 against 0.878-0.902 ms in 4 + 4 alternated runs); a buffer per sub-tile cost the 256-column tile
    one ring stage (Qwen3's down GEMM, K = 768, 2 % faster for it);
  * ``act_inter > 0`` fuses GEMM 1's SiLU·mul and e4m3 requantisation (see ``__init__``): its epilogue also
    writes one fp32 scale per row and 128-column group (``d_scales``, M-major like ``s_a``); with ``glu`` the
    clamped SwiGLU of DeepSeek-V4 (``gates.ClampedGlu``) instead of SiLU·mul.

``trace=True`` compiles a diagnostic build: each role (the producer warp, each math warpgroup) reads ``clock64``
around its stage waits, its waits for its own ``wgmma`` and its epilogue, and its first thread writes the sums and
its tile count to ``[CTAs, TRACE_ROLES, len(TRACE_FIELDS)]`` int64 counters at its end (``fp8_cute_trace.phase_shares``
reads them). The normal build compiles none of it.

A swizzled schedule (``swizzle_size`` > 1) rounds its grid up to whole swizzle bands: the tiles past the problem
(row block or column tile out of range) are idle for producer and consumers alike, as unused row blocks are.

Invariants: K and N are multiples of 128 (the scale block; the checkpoints' expert shapes all are) and N of
``tile_n`` (``fp8_cute._check_operands`` falls back to 128 where a wide tile does not divide N), the
rows of A are the routing plan's padded rows (a multiple of 128 per expert), A's padding rows are finite
(zeros), ``s_a`` is M-major (``[K/128, M]`` in memory) so a warp's row scales are one coalesced load.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..quant.scheme import E4M3_MAX, FP8_SCALE_BLOCK
from ._fp8_cute_steps import (acquire, act_mul_amax, divide_rows, finish_step, issue, load_scales, mma, scale_products,
                              wait_mma, wait_stage)
from .fp8_cute_trace import TRACE_FIELDS, TRACE_ROLES

#: rows of a tile: two math warpgroups × the 64 rows of one wgmma
TILE_M = 128
#: registers per thread of the producer warpgroup after ``setmaxnreg`` (it only issues TMA copies)
LOAD_REGISTERS = 40
#: registers per thread of the math warpgroups: 2 × 64 fp32 accumulators (scratch and promoted) at
#: BLOCK_N = 128, plus fragments and addresses; 128·40 + 256·232 ≤ 65,536 registers of the SM
MMA_REGISTERS = 232
#: shared memory the ring may use: the SM's 227 KiB minus the mbarriers
SMEM_CAPACITY = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
#: columns of an epilogue sub-tile (128 × 32: one ``stmatrix`` pass of the C fragment, the example's); a tile has
#: one TMA store buffer per sub-tile (``epi_stages``: 4 at 128 columns, 8 at 256), so its epilogue never waits for
#: its own stores — they drain during the next tile's mainloop
EPI_SUBTILE_N = 32
#: the wide output tile: two 128-column B tiles (registers: 3 × 64 fp32 accumulators, as the fused gate_up)
WIDE_TILE_N = 256


class BlockScaledGroupedGemm:
    """``D[m, n] = Σ_kb s_a[m, kb] · s_b[e(m), n // 128, kb] · Σ_{k in kb} A[m, k] · B[e(m)][n, k]``.

    A ``[M, K]`` e4m3, s_a ``(M, K/128)`` fp32 M-major, B ``(N, K, E)`` e4m3 (the ``[E, N, K]`` weights),
    s_b ``(N/128, K/128, E)`` fp32, D ``[M, N]`` 16-bit (bf16/fp16: the epilogue's ``stmatrix`` is 16-bit),
    ``block_expert [M/128]`` int32 (-1: idle).
    """

    def __init__(self, k_tiles: int, tile_n: int = 128, raster_along_m: bool = False, swizzle_size: int = 1,
                 cluster_n: int = 2, act_inter: int = 0, trace: bool = False, glu=None):
        if tile_n not in (64, 128, WIDE_TILE_N):
            raise ValueError(f"BLOCK_N must be 64, 128 or {WIDE_TILE_N}, got {tile_n}")
        #: the output tile's width; 256 is two 128-column B tiles per stage through two accumulators — the fused
        #: gate_up's mainloop with adjacent columns instead of gate and up rows: A is read from shared memory and
        #: L2 once per 256 columns and a tile's epilogue covers twice the work
        self.tile_n_out = tile_n
        #: the (M, N, K) of one MMA and B tile: N at most one scale block
        self.tile_shape_mnk = (TILE_M, min(tile_n, FP8_SCALE_BLOCK), FP8_SCALE_BLOCK)
        #: K / 128 (a compile-time constant)
        self.k_tiles = k_tiles
        if cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
        #: CTAs of a cluster along N: they share one row block, so its A tile is multicast to both (each loads
        #: half) — the same expert, so idle blocks are skipped by the whole cluster alike
        self.cluster_n = cluster_n
        #: > 0: GEMM 1 fused with act·mul and the e4m3 requantisation — the weights are gate_up ``[E, 2I, H]``
        #: with I = act_inter, a CTA's column tile is one 128-column activation group: its gate rows and its up
        #: rows (I further) load into two B buffers of a stage, two accumulators hold them, and the epilogue
        #: writes ``silu(gate) · up`` quantized per row and group (e4m3 + one fp32 scale per row) — no
        #: ``[rows, 2I]`` intermediate in HBM
        self.act_inter = act_inter
        if act_inter and (act_inter % FP8_SCALE_BLOCK or tile_n != FP8_SCALE_BLOCK):
            raise ValueError(f"the fused gate_up needs I a multiple of {FP8_SCALE_BLOCK} and BLOCK_N = {FP8_SCALE_BLOCK}")
        #: two B tiles per stage, two accumulators (the fused gate_up, or a 256-column tile)
        self.two_b = act_inter > 0 or tile_n == WIDE_TILE_N
        #: the fused gate_up's clamped SwiGLU (``gates.ClampedGlu``: ``_fp8_cute_steps.act_mul_amax``), its fields
        #: compiled in as constants; None: plain SiLU
        self.glu = glu
        if glu is not None and not act_inter:
            raise ValueError("a clamped gated activation is an epilogue of the fused gate_up (act_inter > 0) only")
        #: the trace build: SM-cycle counters of each role's waits and epilogue (``TRACE_FIELDS``), written once per
        #: role at its end — a diagnostic (its clock reads cost a few instructions a K step); off, it is not compiled in
        self.trace = trace

        self.raster_along_m = raster_along_m
        self.swizzle_size = swizzle_size
        self.acc_dtype = cutlass.Float32
        self.atom_layout_mnk = (2, 1, 1)
        self.num_mma_warp_groups = 2
        self.threads_per_warp_group = 128
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.threads_per_warp_group
        self.load_warp_id = 0
        self.epi_store_warp_id = 4
        self.num_mma_threads = self.num_mma_warp_groups * self.threads_per_warp_group
        self.epilog_sync_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

        self.buffer_align_bytes = 1024

    def _make_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_shape_mnk[1]))

    def _setup(self):
        # two copies of the same MMA: one that zeroes its accumulator (a K step's first k32), one that adds
        # (the other three) — set once, so no MMA state is mutated inside the traced loops
        self.tiled_mma = self._make_mma()
        self.tiled_mma_acc = self._make_mma()

        mma_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        if mma_k * 4 != FP8_SCALE_BLOCK:
            raise ValueError(f"expected a k{FP8_SCALE_BLOCK // 4} fp8 wgmma, got k{mma_k}")
        self.epi_tile = (TILE_M, EPI_SUBTILE_N)
        b_tiles = 2 if self.two_b else 1
        ab_bytes = (TILE_M + b_tiles * self.tile_shape_mnk[1]) * FP8_SCALE_BLOCK  # e4m3: 1 byte per element
        self.epi_stages = self.tile_n_out // self.epi_tile[1]
        epi_bytes = cute.size(self.epi_tile) * self.c_dtype.width // 8 * self.epi_stages
        self.ab_stage = (SMEM_CAPACITY - 1024 - epi_bytes) // ab_bytes
        self.a_smem_layout_staged = self._staged(self.a_layout, self.a_dtype, (TILE_M, FP8_SCALE_BLOCK))
        self.b_smem_layout_staged = self._staged(self.b_layout, self.b_dtype, (self.tile_shape_mnk[1], FP8_SCALE_BLOCK))
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.c_layout, self.c_dtype, self.epi_tile[1]), self.c_dtype)
        self.epi_smem_layout_staged = cute.tile_to_shape(c_atom, cute.append(self.epi_tile, self.epi_stages),
                                                         order=(0, 1, 2))

    def _staged(self, layout, dtype, shape):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(layout, dtype, FP8_SCALE_BLOCK), dtype)
        return cute.tile_to_shape(atom, cute.append(shape, self.ab_stage), order=(0, 1, 2))

    @cute.jit
    def __call__(self, a: cute.Tensor, sa: cute.Tensor, b: cute.Tensor, sb: cute.Tensor, d: cute.Tensor,
                 d_scales: cute.Tensor, block_expert: cute.Tensor, trace: cute.Tensor,
                 max_active_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.c_dtype = d.element_type
        self.a_layout = LayoutEnum.from_tensor(a)
        self.b_layout = LayoutEnum.from_tensor(b)
        self.c_layout = LayoutEnum.from_tensor(d)
        self._setup()
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        g2s_a = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_n > 1 else g2s
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_a, a, cute.slice_(self.a_smem_layout_staged, (None, None, 0)), (TILE_M, FP8_SCALE_BLOCK),
            num_multicast=self.cluster_n)
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(self.b_smem_layout_staged, (None, None, 0)), (self.tile_shape_mnk[1], FP8_SCALE_BLOCK))
        tma_atom_d, tma_d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), d,
            cute.slice_(self.epi_smem_layout_staged, (None, None, 0)), self.epi_tile)
        gd = cute.zipped_divide(d, tiler=(TILE_M, self.tile_n_out))
        sched_params = utils.PersistentTileSchedulerParams(
            gd[(0, (None, None, None))].shape, (1, self.cluster_n, 1), self.swizzle_size, self.raster_along_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)

        @cute.struct
        class SharedStorage:
            ring: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout_staged)],
                                  self.buffer_align_bytes]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout_staged)],
                                  self.buffer_align_bytes]
            sB2: cute.struct.Align[cute.struct.MemRange[
                self.b_dtype, cute.cosize(self.b_smem_layout_staged) if self.two_b else 16], self.buffer_align_bytes]
            sD: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout_staged)],
                                  self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom_a, tma_a, sa, tma_atom_b, tma_b, sb, tma_atom_d, tma_d, d_scales, block_expert, trace,
                    self.tiled_mma,
                    self.tiled_mma_acc, self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
                    sched_params).launch(grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, self.cluster_n, 1),
                                         min_blocks_per_mp=1, stream=stream)

    @cute.jit
    def from_pointers(self, a_ptr: cute.Pointer, sa_ptr: cute.Pointer, b_ptr: cute.Pointer, sb_ptr: cute.Pointer,
                      d_ptr: cute.Pointer, ds_ptr: cute.Pointer, be_ptr: cute.Pointer, tr_ptr: cute.Pointer,
                      rows: cutlass.Int32,
                      num_experts: cutlass.Int32, a_row: cutlass.Int64, sa_k: cutlass.Int64, b_row: cutlass.Int64,
                      b_expert: cutlass.Int64, sb_row: cutlass.Int64, sb_expert: cutlass.Int64, d_row: cutlass.Int64,
                      ds_n: cutlass.Int64, n: cutlass.Constexpr, n_out: cutlass.Constexpr,
                      max_active_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        """``__call__`` on operands given as raw device pointers, row counts and strides (``fp8_cute``'s launch
        path): the tensor views are built here, in the compiled host function, instead of by 7 DLPack
        conversions per launch in Python (52 µs on a 2-core CPU machine against 8 µs for the pointers). K, N and
        the output width are compile-time; the row count, the expert count and every stride past the unit
        one are run-time (Int64 strides: rows × N passes 2³¹ at 64K tokens of DeepSeek-V3). ``tr_ptr``: the trace
        build's counters ``[CTAs, TRACE_ROLES, len(TRACE_FIELDS)]`` int64 (unread by the normal build)."""
        k = self.k_tiles * FP8_SCALE_BLOCK
        a = cute.make_tensor(a_ptr, cute.make_layout((rows, k, 1), stride=(a_row, 1, rows * a_row)))
        sa = cute.make_tensor(sa_ptr, cute.make_layout((rows, self.k_tiles), stride=(1, sa_k)))
        b = cute.make_tensor(b_ptr, cute.make_layout((n, k, num_experts), stride=(b_row, 1, b_expert)))
        sb = cute.make_tensor(sb_ptr, cute.make_layout((n // FP8_SCALE_BLOCK, self.k_tiles, num_experts),
                                                       stride=(sb_row, 1, sb_expert)))
        d = cute.make_tensor(d_ptr, cute.make_layout((rows, n_out, 1), stride=(d_row, 1, rows * d_row)))
        ds = cute.make_tensor(ds_ptr, cute.make_layout((rows, n_out // FP8_SCALE_BLOCK), stride=(1, ds_n)))
        block_expert = cute.make_tensor(be_ptr, cute.make_layout(rows // TILE_M))
        trace = cute.make_tensor(tr_ptr, cute.make_layout(
            (max_active_clusters * self.cluster_n, TRACE_ROLES, len(TRACE_FIELDS)),
            stride=(TRACE_ROLES * len(TRACE_FIELDS), len(TRACE_FIELDS), 1)))
        self.__call__(a, sa, b, sb, d, ds, block_expert, trace, max_active_clusters, stream)

    @cute.jit
    def write_trace(self, mTrace: cute.Tensor, role: cutlass.Int32, began: cutlass.Int64, stage_wait: cutlass.Int64,
                    mma_wait: cutlass.Int64, epilogue: cutlass.Int64, tiles: cutlass.Int32, tidx: cutlass.Int32):
        """The trace build's counters of one role, written by its first thread (``TRACE_FIELDS`` order)."""
        if tidx % self.threads_per_warp_group == 0:
            bx, by, bz = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            cta = bx + gx * (by + gy * bz)
            mTrace[(cta, role, 0)] = cute.arch.clock64() - began
            mTrace[(cta, role, 1)] = stage_wait
            mTrace[(cta, role, 2)] = mma_wait
            mTrace[(cta, role, 3)] = epilogue
            mTrace[(cta, role, 4)] = cutlass.Int64(tiles)

    @cute.jit
    def tile_expert(self, mBlockExpert: cute.Tensor, m_blk: cutlass.Int32, n_blk: cutlass.Int32,
                    num_m_blocks: cutlass.Int32, num_n_tiles: cutlass.Int32) -> cutlass.Int32:
        """The expert of the scheduler's tile (``m_blk``, ``n_blk``), or -1 where the tile is idle: an unused row block
        (``block_expert`` -1) or a swizzle band's padding tile past the problem, whose row block is not read. The one
        lookup of the producer and the consumers, so both skip the same tiles."""
        expert = cutlass.Int32(-1)
        if m_blk < num_m_blocks:
            if n_blk < num_n_tiles:
                expert = mBlockExpert[m_blk]
        return expert

    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, mSA: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB: cute.Tensor, mSB: cute.Tensor, tma_atom_d: cute.CopyAtom, mD: cute.Tensor, mDS: cute.Tensor,
               mBlockExpert: cute.Tensor, mTrace: cute.Tensor, tiled_mma: cute.TiledMma, tiled_mma_acc: cute.TiledMma,
               a_smem_layout_staged: cute.ComposedLayout,
               b_smem_layout_staged: cute.ComposedLayout, epi_smem_layout_staged: cute.ComposedLayout,
               sched_params: utils.PersistentTileSchedulerParams):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_d)

        a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tma_bytes = cute.size_in_bytes(self.a_dtype, a_smem_layout) + (2 if self.two_b else 1) * cute.size_in_bytes(
            self.b_dtype, b_smem_layout)
        cluster_mn = (1, self.cluster_n)
        cta_layout_mnk = cute.make_layout((1, self.cluster_n, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1) if self.cluster_n > 1 else 0
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # a stage is free once every math warp of *both* CTAs released it (each CTA's TMA writes both A halves)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.cluster_n * self.num_mma_warp_groups * 4),
            tx_count=tma_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        # the up tiles of the fused gate_up, the right halves of a wide tile (unused, 16 bytes, otherwise)
        sB2 = storage.sB2.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner) \
            if self.two_b else sB
        sD = storage.sD.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)
        # (bM, bK, RestM, RestK, RestL) / (bN, bK, RestN, RestK, RestE) / (bM, bN, RestM, RestN, RestL)
        gA = cute.local_tile(mA, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD, (TILE_M, self.tile_n_out), (None, None, None))
        one = cute.make_layout(1)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_atom_b, 0, one, cute.group_modes(sB, 0, 2),
                                                      cute.group_modes(gB, 0, 2))
        tBsB2, _ = cute.nvgpu.cpasync.tma_partition(tma_atom_b, 0, one, cute.group_modes(sB2, 0, 2),
                                                    cute.group_modes(gB, 0, 2))
        # the second B tile of a stage, in B tiles (and scale rows) after the first: the up half's first column
        # tile for the fused gate_up, the next one for a wide tile
        second_b = self.act_inter // FP8_SCALE_BLOCK if self.act_inter else 1
        b_per_tile = self.tile_n_out // self.tile_shape_mnk[1]  # B tiles per output tile (1, or 2 when wide)
        # tiles past the problem: a swizzled schedule rounds its grid up to whole swizzle bands
        num_m_blocks = cute.size(mBlockExpert)
        num_n_tiles = cute.size(mD, mode=[1]) // self.tile_n_out

        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warp_group)
        mma_thread_layout = cute.make_layout(self.num_mma_warp_groups, stride=self.threads_per_warp_group)
        thr_mma = tiled_mma.get_slice(mma_thread_layout(warp_group_idx - 1))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCrB2 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB2))
        # one accumulator covers one MMA tile (a wide tile holds two)
        mma_tile_mn = cute.slice_(self.tile_shape_mnk, (None, None, 0))
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor(mma_tile_mn)).shape[:3]
        if cutlass.const_expr(cute.size(acc_shape, mode=[0]) != self.tile_shape_mnk[1] // 2
                              or cute.size(acc_shape) != cute.size(acc_shape, mode=[0])):
            raise ValueError(f"unexpected wgmma C fragment {acc_shape}: the promotion's row selection assumes "
                             "((2, 2, N/8), 1, 1)")
        accumulators = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        accum_temp = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        accumulators2 = cute.make_rmem_tensor(acc_shape, self.acc_dtype) if self.two_b else accumulators
        # the row (within the tile) of every accumulator element of *this thread*: ``thr_mma`` above is the
        # warpgroup's slice (what its wgmma operands need); the C fragment's coordinates need the thread's own
        tCcD = tiled_mma.get_slice(tidx - self.threads_per_warp_group).partition_C(
            cute.make_identity_tensor((TILE_M, self.tile_shape_mnk[1])))
        pipeline_init_wait(cluster_shape_mn=cluster_mn)

        is_producer = warp_group_idx == 0
        if is_producer:
            cute.arch.setmaxregister_decrease(LOAD_REGISTERS)
        # the trace build's counters of this thread's role (kept only by the role's first thread)
        began = cute.arch.clock64() if self.trace else cutlass.Int64(0)
        stage_wait, mma_wait, epilogue = cutlass.Int64(0), cutlass.Int64(0), cutlass.Int64(0)
        tiles_done = cutlass.Int32(0)
        if warp_idx == self.load_warp_id:
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                              cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            while work.is_valid_tile:
                m_blk, n_blk, _ = work.tile_idx
                expert = self.tile_expert(mBlockExpert, m_blk, n_blk, num_m_blocks, num_n_tiles)
                if expert >= 0:
                    tAgA_m = tAgA[(None, m_blk, None, 0)]
                    tBgB_n = tBgB[(None, n_blk * b_per_tile, None, expert)]
                    state.reset_count()
                    for _k in range(self.k_tiles):
                        stage_wait += acquire(ring, state, self.trace)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_atom_a, tAgA_m[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=a_mcast_mask)
                        cute.copy(tma_atom_b, tBgB_n[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(self.two_b):
                            cute.copy(tma_atom_b, tBgB[(None, n_blk * b_per_tile + second_b, None, expert)][
                                (None, state.count)], tBsB2[(None, state.index)], tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                    tiles_done += 1
                sched.advance_to_next_work()
                work = sched.get_current_work()
            ring.producer_tail(state)
            if cutlass.const_expr(self.trace):
                self.write_trace(mTrace, 0, began, stage_wait, mma_wait, epilogue, tiles_done, tidx)

        if not is_producer:
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            tiled_mma_acc.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            mmas = (tiled_mma, tiled_mma_acc)
            sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(),
                                                              cute.arch.grid_dim())
            work = sched.initial_work_tile_info()
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            num_k_blocks = cute.size(tCrA, mode=[2])
            copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype,
                                                              elem_ty_acc=self.acc_dtype)
            copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                                              self.c_dtype)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
            thr_copy_r2s = tiled_copy_r2s.get_slice(tidx - self.threads_per_warp_group)
            tRS_sD = thr_copy_r2s.partition_D(sD)
            tRS_rAcc = tiled_copy_r2s.retile(accumulators)
            tRS_rAcc2 = tiled_copy_r2s.retile(accumulators2)  # a wide tile's right half
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
            tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.c_dtype)
            size_tRS_rD = cute.size(tRS_rD)
            # this thread's two accumulator rows (the wgmma C fragment holds rows r and r + 8 of its warp)
            row_lo = tCcD[0][0]
            row_hi = tCcD[2][0]
            # ``ahead``: the current tile's first MMA (its gate / left half, or a plain tile's whole first step) was
            # issued before the previous tile's epilogue, with its first scales loaded then too — the tensor cores
            # work through it while both warpgroups convert and store (an epilogue leaves them idle otherwise)
            ahead = cutlass.Boolean(False)
            a_lo, a_hi = cutlass.Float32(0.0), cutlass.Float32(0.0)
            w_s, w_u = cutlass.Float32(0.0), cutlass.Float32(0.0)
            next_m, next_n = cutlass.Int32(0), cutlass.Int32(0)
            # one MMA is in flight at the top of every iteration: the next live tile's first, or a stand-in
            mma(read_state, mmas, tCrA, tCrB, accum_temp, num_k_blocks)
            while work.is_valid_tile:
                m_blk, n_blk, _ = work.tile_idx
                expert = self.tile_expert(mBlockExpert, m_blk, n_blk, num_m_blocks, num_n_tiles)
                sched.advance_to_next_work()
                work = sched.get_current_work()
                if expert >= 0:
                    m0 = m_blk * TILE_M
                    read_state.reset_count()
                    release_state.reset_count()
                    nb = n_blk * self.tile_n_out // FP8_SCALE_BLOCK
                    rows = (m0 + row_lo, m0 + row_hi)
                    # A warpgroup's promotion needs its own MMA's result; the other warpgroup's MMA runs meanwhile.
                    # Measured on H200 and not kept: taking turns between the warpgroups through named barriers
                    # (20-30 % slower), each step's MMA as two column halves promoted one after the other (no
                    # gain), two full-width scratch accumulators in flight (ptxas serialises every wgmma: C7514).
                    # Step k's scales are loaded during step k - 1 (loop-carried): loaded and used in the same
                    # step, their L2 round trip stalled every MMA issue (up to 25 % of the time, measured).
                    if not ahead:  # the MMA in flight was a stand-in (the tile before was idle): the real one
                        a_lo, a_hi, w_s, w_u = load_scales(mSA, mSB, *rows, nb, second_b, 0, expert, self.two_b)
                        mma_wait += wait_mma(self.trace)
                        stage_wait += issue(ring, read_state, mmas, tCrA, tCrB, accum_temp, num_k_blocks, self.trace)
                    accumulators.fill(0.0)
                    if cutlass.const_expr(self.two_b):
                        accumulators2.fill(0.0)
                    # every step but the last: wait for the step's first MMA (issued before the loop, or ahead, for
                    # step 0; at the end of the step before for the others), promote, and issue the next step's
                    for k_tile in range(self.k_tiles - 1):
                        sc, sc_u = scale_products(a_lo, a_hi, w_s, w_u)
                        a_lo, a_hi, w_s, w_u = load_scales(mSA, mSB, *rows, nb, second_b, k_tile + 1, expert,
                                                           self.two_b)
                        mma_wait += finish_step(ring, read_state, release_state, mmas, tCrA, tCrB2, accumulators,
                                                accumulators2, accum_temp, sc, sc_u, num_k_blocks, self.two_b,
                                                self.trace)
                        read_state.advance()
                        release_state.advance()
                        stage_wait += issue(ring, read_state, mmas, tCrA, tCrB, accum_temp, num_k_blocks, self.trace)
                    sc, sc_u = scale_products(a_lo, a_hi, w_s, w_u)
                    mma_wait += finish_step(ring, read_state, release_state, mmas, tCrA, tCrB2, accumulators,
                                            accumulators2, accum_temp, sc, sc_u, num_k_blocks, self.two_b, self.trace)
                    read_state.advance()
                    release_state.advance()
                    # the next live tile's first MMA and scales, before this tile's epilogue
                    ahead = cutlass.Boolean(False)
                    next_expert = cutlass.Int32(-1)
                    if work.is_valid_tile:
                        next_m, next_n, _ = work.tile_idx
                        next_expert = self.tile_expert(mBlockExpert, next_m, next_n, num_m_blocks, num_n_tiles)
                    if next_expert >= 0:
                        next_nb = next_n * self.tile_n_out // FP8_SCALE_BLOCK
                        a_lo, a_hi, w_s, w_u = load_scales(mSA, mSB, next_m * TILE_M + row_lo, next_m * TILE_M + row_hi,
                                                           next_nb, second_b, 0, next_expert, self.two_b)
                        stage_wait += wait_stage(ring, read_state, self.trace)
                        ahead = cutlass.Boolean(True)
                    # issued whether or not a live tile follows (a stand-in on a stale stage then, its result never
                    # read): a wgmma issued on one branch only makes ptxas wait for it where the branches join (C7517)
                    mma(read_state, mmas, tCrA, tCrB, accum_temp, num_k_blocks)
                    epilogue_began = cute.arch.clock64() if self.trace else cutlass.Int64(0)

                    if cutlass.const_expr(self.act_inter > 0):
                        # silu(gate) · up, then the e4m3 quantisation of the row's 128-column group: a row's
                        # columns lie in the 4 lanes of a quad (the C fragment), so its amax is a 2-step butterfly
                        amax_lo, amax_hi = act_mul_amax(accumulators, accumulators2, self.glu)
                        for off in cutlass.range_constexpr(2):
                            amax_lo = cute.arch.fmax(amax_lo, cute.arch.shuffle_sync_bfly(amax_lo, 1 << off))
                            amax_hi = cute.arch.fmax(amax_hi, cute.arch.shuffle_sync_bfly(amax_hi, 1 << off))
                        s_lo = amax_lo / E4M3_MAX
                        s_hi = amax_hi / E4M3_MAX
                        if amax_lo == 0.0:
                            s_lo = cutlass.Float32(1.0)
                        if amax_hi == 0.0:
                            s_hi = cutlass.Float32(1.0)
                        divide_rows(accumulators, s_lo, s_hi)
                        if tidx % 4 == 0:
                            mDS[(rows[0], n_blk)] = s_lo
                            mDS[(rows[1], n_blk)] = s_hi

                    gD_tile = gD[(None, None, m_blk, n_blk, 0)]
                    tCgD_epi = cute.zipped_divide(gD_tile, self.epi_tile)
                    bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                        tma_atom_d, 0, one, cute.group_modes(sD, 0, 2), tCgD_epi)
                    epi_tile_num = cute.size(tCgD_epi, mode=[1])
                    epi_shape = tCgD_epi.shape[1]
                    epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                    half_tiles = self.tile_shape_mnk[1] // self.epi_tile[1]  # sub-tiles per accumulator
                    # every sub-tile has its own store buffer: the previous tile's stores (issued a mainloop ago)
                    # must have read theirs before any thread writes, then all sub-tiles go to shared memory, and
                    # after one proxy fence and one barrier the store warp issues all their TMA stores as one group
                    if warp_idx == self.epi_store_warp_id:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    self.epilog_sync_barrier.arrive_and_wait()
                    for epi_idx in cutlass.range_constexpr(epi_tile_num):
                        source = tRS_rAcc if epi_idx < half_tiles else tRS_rAcc2
                        for v in cutlass.range_constexpr(size_tRS_rD):
                            tRS_rD[v] = source[(epi_idx % half_tiles) * size_tRS_rD + v]
                        tRS_rD_out.store(tRS_rD.load().to(self.c_dtype))
                        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, epi_idx)])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epilog_sync_barrier.arrive_and_wait()
                    if warp_idx == self.epi_store_warp_id:
                        for epi_idx in cutlass.range_constexpr(epi_tile_num):
                            cute.copy(tma_atom_d, bSG_sD[(None, epi_idx)],
                                      bSG_gD[(None, epi_layout.get_hier_coord(epi_idx))])
                        cute.arch.cp_async_bulk_commit_group()
                    tiles_done += 1
                    if cutlass.const_expr(self.trace):
                        epilogue += cute.arch.clock64() - epilogue_began
            wait_mma()  # the last stand-in
            if warp_idx == self.epi_store_warp_id:
                cute.arch.cp_async_bulk_wait_group(0)  # the last tile's stores, before the CTA's smem goes
            if cutlass.const_expr(self.trace):
                self.write_trace(mTrace, warp_group_idx, began, stage_wait, mma_wait, epilogue, tiles_done, tidx)
