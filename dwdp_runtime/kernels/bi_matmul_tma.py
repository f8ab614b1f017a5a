"""``bi_matmul``'s TMA form: both operand tiles of a batch-invariant GEMM brought by the copy engine.

``launch_tma(a3, b3, c3, bias, tile)`` runs ``_tma_mm`` — one output tile per program, host-side TMA descriptors
of the ``[B, M, K]`` activations and of the weight (``[B, N, K]`` for an ``nn.Linear`` weight's ``.t()``, else
``[B, K, N]``), zero-filled past M, N and K — with ``bi_matmul``'s arithmetic: the same tiling, ascending
``BLOCK_K`` steps, fp32 accumulation, one rounding (``bi_matmul`` docstring: the invariant). Whether it runs
depends on the weight's layout only (``_weight_view``); an activation view TMA cannot describe is copied first,
never sent to another kernel. It returns False (nothing launched) for a weight TMA cannot describe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast_out
from .bi_tiling import GROUP_M, TMA_ALIGN, Tile, _dot, _swizzled_tile
from .support import interpreting


@triton.jit(do_not_specialize=["M", "s_cb"])
def _tma_mm(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, s_cb, s_cm, s_cn,
            HAS_BIAS: tl.constexpr, B_NK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, INTERP: tl.constexpr, EXACT_BF16: tl.constexpr):
    """One output tile per program, both operand tiles through TMA descriptors of the ``[B, M, K]`` activations
    and of the weight (``[B, N, K]`` when ``B_NK``: an ``nn.Linear`` weight's ``.t()``, else ``[B, K, N]``); the
    copy engine zero-fills past M, N and K, so there are no predicates and a ragged K step adds exact zeros. The
    arithmetic of an element is ``_tiled_mm``'s (same tiling, same ascending K steps)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    pid_m, pid_n = _swizzled_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending, fixed step: the reduction order of every element
        a = tl.reshape(a_desc.load([batch, off_m, k0]), [BLOCK_M, BLOCK_K])
        if B_NK:
            b = tl.trans(tl.reshape(b_desc.load([batch, off_n, k0]), [BLOCK_N, BLOCK_K]))
        else:
            b = tl.reshape(b_desc.load([batch, k0, off_n]), [BLOCK_K, BLOCK_N])
        acc = _dot(a, b, acc, INTERP, False)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = cast_out(acc, c_ptr.dtype.element_ty, EXACT_BF16)
    c_ptr += batch.to(tl.int64) * s_cb
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn, c,
             mask=(offs_m < M)[:, None] & mask_n[None, :])


def _tma_describable(t: torch.Tensor) -> bool:
    """TMA can describe this 3-D view as it lies: last axis contiguous, the other strides and the base 16-byte
    multiples, no broadcast (stride-0) axis of more than one element."""
    es = t.element_size()
    return (t.stride(2) == 1 and t.data_ptr() % TMA_ALIGN == 0
            and all((t.stride(d) * es) % TMA_ALIGN == 0 and (t.stride(d) > 0 or t.shape[d] == 1) for d in (0, 1)))


def _weight_view(b3: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``b3 [B, K, N]`` as TMA sees it: ``([B, N, K] view, True)`` for a transposed ``nn.Linear`` weight (K
    contiguous), ``(b3, False)`` for a row-major one (N contiguous), None when TMA cannot describe either."""
    transposed = b3.transpose(1, 2)
    if b3.stride(1) == 1 and _tma_describable(transposed):
        return transposed, True
    if b3.stride(2) == 1 and _tma_describable(b3):
        return b3, False
    return None


def launch_tma(a3, b3, c3, bias, tile: Tile) -> bool:
    """``_tma_mm`` on these operands; False (nothing launched) when the weight's layout is not describable —
    a property of the weight, the same for every batch. Activations TMA cannot describe are copied first."""
    weight = _weight_view(b3)
    if weight is None:
        return False
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not _tma_describable(a3):
        a3 = a3.contiguous() if not a3.is_contiguous() else a3.clone()
        if not _tma_describable(a3):  # K's rows are not 16-byte multiples: a property of K, no copy helps
            return False
    b_view, b_nk = weight
    nb, m, k = a3.shape
    n = b3.shape[-1]
    b_block = [1, tile.block_n, tile.block_k] if b_nk else [1, tile.block_k, tile.block_n]
    a_desc = TensorDescriptor(a3, list(a3.shape), list(a3.stride()), [1, tile.block_m, tile.block_k])
    b_desc = TensorDescriptor(b_view, list(b_view.shape), list(b_view.stride()), b_block)
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), nb)
    _tma_mm[grid](a_desc, b_desc, c3, bias if bias is not None else c3, m, n, k,
                  c3.stride(0), c3.stride(1), c3.stride(2),
                  HAS_BIAS=bias is not None, B_NK=b_nk, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  BLOCK_K=tile.block_k, GROUP=GROUP_M, INTERP=interpreting(), EXACT_BF16=interpreting(),
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    return True
