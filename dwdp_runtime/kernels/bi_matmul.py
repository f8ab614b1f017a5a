"""Batch-invariant dense matmul: a persistent Triton GEMM whose per-element arithmetic does not depend on M.

``matmul(a, b, bias=None)``: ``a [.., M, K] @ b [.., K, N] (+ bias [N])`` → ``[.., M, N]`` in ``a``'s dtype,
any strides (no copy of a weight's ``.t()`` view), an optional leading batch dimension (``bmm``).

Invariant (what ``--batch-invariant`` rests on): output element ``(m, n)`` is ``round(Σ_k a[m,k]·b[k,n]
(+ bias[n]))`` accumulated in fp32 over K in ``BLOCK_K``-wide steps in ascending order, inside one
``tl.dot`` tiling that is chosen from ``(N, K, dtype)`` only (``config_for``) — never from M. No split-K, no
atomics, no stream-K: a row's result is the same bits whether it is computed alone (M = 1) or as row 9,000
of a packed batch. cuBLAS does not promise that: it picks another kernel (tiling, split-K) for another M, which
is why Qwen3-MoE and Mixtral logits differed alone vs packed at ``self_attn.o_proj`` (issue #34).

Three kernels, one arithmetic (which one runs is part of the M-free tiling, ``Tile.kernel``): ``_persistent_mm``, a
grid of at most ``NUM_PROGRAMS`` (the SM count on H200: 132) programs walking the output tiles ``pid, pid +
NUM_PROGRAMS, …`` in GROUP_M-swizzled order, for the narrow GEMMs (routers); ``_tiled_mm``, one tile per program
with the K loop walking pointers and the edge rows read wrapped (no row predicate on the loads);
``bi_matmul_tma._tma_mm``, one tile per program with both operand tiles brought by the copy engine (host-side TMA
descriptors, zero-filled past M, N and K), for every projection whose K and N rows are 16-byte multiples
(``bench/bi_tiles.py`` compares them). Which program computes a tile, and whether its operands arrive by
pointer or by TMA, changes nothing in the tile's arithmetic. Whether ``_tma_mm`` runs depends on ``(N, K, dtype)``
and on the weight's layout, never on the activations: an activation view TMA cannot describe (misaligned, K not
contiguous) is copied first. ``M`` and the
batch strides (multiples of M) are not specialised (``do_not_specialize``): Triton would otherwise compile another
variant for M = 1 or M divisible by 16, which must not be a second code path.
Speed (``bench/bi_tiles.py``, H100, 2026-12-07, log docs/gpu-runs/2026-12-07-h100-bi-check.log): ``_tma_mm``
128×256 runs the projections of Qwen3-30B and DeepSeek-V3 at 0.89-1.25× cuBLAS at 4K-16K rows (0.72-0.76× for
kv_b_proj, 0.61-0.63× for kv_a_proj's 576 columns); the pointer form ``_tiled_mm`` it replaced ran at 0.29-0.45×
(the same tiling: the copy engine is the difference).

Precision: 16-bit operands use tensor cores with fp32 accumulation; fp32 operands use ``ieee`` (torch's
default matmul precision is full fp32, ``allow_tf32 = False``), e.g. DeepSeek-V3's fp32 router.

Interpreter (CPU tests): the K step is a broadcast product summed in fp32 (``_dot``: numpy's BLAS, the
interpreter's ``tl.dot``, is not position-independent inside a tile, and multiplies bf16 as raw bits) and the
epilogue rounds on the bits (``_cast``). The CPU tests therefore check the structural half of the invariant
(tiling, masks and reduction order free of M); the GPU test checks the hardware half (an MMA computes an
element the same way wherever it sits in the tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast_out
from .bi_matmul_tma import launch_tma
from .bi_tiling import DEFAULT_PROGRAMS, GROUP_M, SUPPORTED, TMA_ALIGN, Kernel, Tile, _dot, _swizzled_tile, config_for
from .support import interpreting

#: the tiling names callers reach through this module (``bi_tiling`` defines them)
__all__ = ["TMA_ALIGN", "Kernel", "Tile", "config_for", "launch", "matmul", "num_programs", "supports"]


@triton.jit(do_not_specialize=["M", "s_ab", "s_cb"])
def _persistent_mm(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                   s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, INTERP: tl.constexpr, IEEE: tl.constexpr,
                   EXACT_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    a_ptr += batch * s_ab
    b_ptr += batch * s_bb
    c_ptr += batch * s_cb
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = _swizzled_tile(tile, num_m, num_n, GROUP)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * s_am
        b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # ascending, fixed step: the reduction order of every element
            kk = k0 + offs_k
            if EVEN_K:  # no K mask: the loads vectorise and pipeline without per-step predicates
                a = tl.load(a_rows + kk[None, :] * s_ak, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_cols + kk[:, None] * s_bk, mask=mask_n[None, :], other=0.0)
            else:
                a = tl.load(a_rows + kk[None, :] * s_ak, mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
                b = tl.load(b_cols + kk[:, None] * s_bk, mask=(kk[:, None] < K) & mask_n[None, :], other=0.0)
            acc = _dot(a, b, acc, INTERP, IEEE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c = cast_out(acc, c_ptr.dtype.element_ty, EXACT_BF16)
        tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn, c,
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M", "s_ab", "s_cb"])
def _tiled_mm(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
              s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP: tl.constexpr, INTERP: tl.constexpr, IEEE: tl.constexpr, EXACT_BF16: tl.constexpr,
              EVEN_K: tl.constexpr):
    """One output tile per program, the K loop walking pointers (Triton's matmul tutorial structure). Rows and
    columns past the edge are read wrapped (``% M``, ``% N``: real data, never stored), so the loads carry no
    row/column predicate; the arithmetic of an element is ``_persistent_mm``'s (same tiling, same K order)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    a_ptr += batch * s_ab
    b_ptr += batch * s_bb
    c_ptr += batch * s_cb
    pid_m, pid_n = _swizzled_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + offs_k[:, None] * s_bk + cols.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending, fixed step: the reduction order of every element
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = _dot(a, b, acc, INTERP, IEEE)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = cast_out(acc, c_ptr.dtype.element_ty, EXACT_BF16)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn, c,
             mask=(offs_m < M)[:, None] & mask_n[None, :])


_PROGRAMS: dict[int, int] = {}


def num_programs(device: torch.device) -> int:
    """The persistent grid: the device's SM count (cached per device), ``DEFAULT_PROGRAMS`` off CUDA."""
    if device.type != "cuda":
        return DEFAULT_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROGRAMS:
        _PROGRAMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS[index]


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel computes this product: same floating dtype, 2-D or 3-D operands with matching batch."""
    return (a.dtype == b.dtype and a.dtype in SUPPORTED and a.dim() == b.dim() and a.dim() in (2, 3)
            and a.shape[-1] == b.shape[-2] and (a.dim() == 2 or a.shape[0] == b.shape[0]))


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)``, batch invariant (module docstring). ``a [M, K]`` / ``[B, M, K]``, ``b [K, N]`` /
    ``[B, K, N]``, ``bias [N]`` (added in fp32 before the one rounding), result in ``a.dtype``."""
    if not supports(a, b):
        raise ValueError(f"bi_matmul: unsupported operands {tuple(a.shape)} {a.dtype} @ {tuple(b.shape)} {b.dtype}")
    batched = a.dim() == 3
    a3 = a if batched else a.unsqueeze(0)
    b3 = b if batched else b.unsqueeze(0)
    nb, m, k = a3.shape
    n = b3.shape[-1]
    if out is None:
        out = torch.empty((nb, m, n) if batched else (m, n), dtype=a.dtype, device=a.device)
    c3 = out if out.dim() == 3 else out.unsqueeze(0)
    if m == 0 or n == 0 or nb == 0:
        return out
    if k == 0:
        c3.zero_()
        if bias is not None:
            c3 += bias.to(c3.dtype)
        return out
    if bias is not None:
        bias = bias.reshape(-1)
        if bias.numel() != n:
            raise ValueError(f"bi_matmul: bias of {bias.numel()} elements for N = {n}")
    tile = config_for(n, k, a.dtype)
    launch(a3, b3, c3, bias, tile, num_programs(a.device), tile.kernel)
    return out


def launch(a3: torch.Tensor, b3: torch.Tensor, c3: torch.Tensor, bias: torch.Tensor | None, tile: Tile,
           programs: int, kernel: Kernel | str = Kernel.PERSISTENT) -> None:
    """One kernel launch on 3-D operands with an explicit tiling and persistent grid (``matmul``'s, or a bench's
    candidate: ``bench/bi_tiles.py``; a tiling chosen from M would break the invariant). ``kernel="tiled"``:
    ``_tiled_mm``, one tile per program; ``"tma"``: ``_tma_mm`` where the weight's layout allows it, else
    ``_tiled_mm`` (the same arithmetic)."""
    nb, m, k = a3.shape
    n = b3.shape[-1]
    tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    kernel = Kernel(kernel)
    if kernel is Kernel.TMA:
        if launch_tma(a3, b3, c3, bias, tile):
            return
    if kernel in (Kernel.TILED, Kernel.TMA):
        _tiled_mm[(tiles, nb)](
            a3, b3, c3, bias if bias is not None else a3, m, n, k,
            a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
            c3.stride(0), c3.stride(1), c3.stride(2),
            HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            GROUP=GROUP_M, INTERP=interpreting(), IEEE=a3.dtype == torch.float32, EXACT_BF16=interpreting(),
            EVEN_K=k % tile.block_k == 0, num_warps=tile.num_warps, num_stages=tile.num_stages)
        return
    _persistent_mm[(min(tiles, programs), nb)](
        a3, b3, c3, bias if bias is not None else a3, m, n, k,
        a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2),
        HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP=GROUP_M, NUM_PROGRAMS=programs, INTERP=interpreting(), IEEE=a3.dtype == torch.float32,
        EXACT_BF16=interpreting(), EVEN_K=k % tile.block_k == 0, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
