"""Top-k reduction: ``out[t] = Σ_j y[t·k + j]`` in fp32, in the fixed order j = 0, 1, …, k-1.

One program per (BLOCK_T tokens × BLOCK_H columns) tile; each token's k rows are contiguous in ``y``
(GEMM 2 wrote them in (token, k) order), so the loads are 16-byte vectors along H. The loop over j is
unrolled at compile time (``tl.static_range``): the summation order is a constant of the program, the
same for every token, every batch and every launch — no atomics, so the result is bitwise reproducible
and does not depend on what else is in the batch (batch invariance).

Pairs whose expert id is outside ``[0, E)`` (expert-parallel sentinels, dropped by the routing plan and
never written by GEMM 2) count as zero: their rows are masked on load, never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .support import interpreting
from ._cast import cast_out

#: columns per program: 1024 bf16 = 2 KiB per row, k rows in flight per program
BLOCK_H = 1024
#: tokens per program (keeps the grid in the low thousands at 32K tokens)
BLOCK_T = 4


@triton.jit
def _reduce_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, num_tokens, H, num_experts, stride_y, stride_o,
                   TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, EXACT_BF16: tl.constexpr,
                   PLAN_ROWS: tl.constexpr):
    # PLAN_ROWS: ``ids_ptr`` holds each pair's row of ``y`` (-1: dropped) and ``w_ptr`` its routing weight,
    # applied here (``reduce_plan_rows``); else pair p's row is p and the weight was applied upstream
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < num_tokens
    ok = t_ok[:, None] & (cols[None, :] < H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tokens.to(tl.int64) * TOP_K + j
        e = tl.load(ids_ptr + pair, mask=t_ok, other=-1)
        if PLAN_ROWS:
            live = e >= 0
            row = e.to(tl.int64)
        else:
            live = (e >= 0) & (e < num_experts)
            row = pair
        v = tl.load(y_ptr + row[:, None] * stride_y + cols[None, :], mask=ok & live[:, None], other=0.0)
        if PLAN_ROWS:
            acc += v.to(tl.float32) * tl.load(w_ptr + pair, mask=live, other=0.0).to(tl.float32)[:, None]
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :], cast_out(acc, out_ptr.dtype.element_ty, EXACT_BF16),
             mask=ok)


def reduce_topk(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out_dtype=None) -> torch.Tensor:
    """``[T, H]`` = fixed-order fp32 sum of each token's k rows of ``y [T·k, H]`` (see module docstring)."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or y.dtype, device=y.device)
    ids = topk_ids.contiguous()
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
    _reduce_kernel[grid](y, ids, ids, out, num_tokens, hidden, num_experts, y.stride(0), out.stride(0),
                         TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, EXACT_BF16=interpreting(), PLAN_ROWS=False,
                         num_warps=4)
    return out


def reduce_weighted_rows(y: torch.Tensor, row_of_pair: torch.Tensor, topk_weights: torch.Tensor,
                         out_dtype=None) -> torch.Tensor:
    """``[T, H]`` = fixed-order fp32 ``Σ_j w[t, j] · y[row_of_pair[t·k + j]]`` (row -1: the pair counts as 0) —
    the same program with the rows looked up and the routing weight applied (``fp8_plan_rows``)."""
    num_tokens, top_k = topk_weights.shape
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or y.dtype, device=y.device)
    weights = topk_weights.contiguous()
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(hidden, BLOCK_H))
    _reduce_kernel[grid](y, row_of_pair, weights, out, num_tokens, hidden, 0, y.stride(0), out.stride(0),
                         TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, EXACT_BF16=interpreting(), PLAN_ROWS=True,
                         num_warps=4)
    return out
