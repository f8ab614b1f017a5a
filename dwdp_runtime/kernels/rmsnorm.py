"""One-pass RMSNorm: ``out = weight · cast(x · rsqrt(mean(x²) + eps))`` — the T5/Llama variant, as
`transformers`' Qwen3-MoE, Mixtral and DeepSeek-V3 norms compute it, in one launch.

`transformers`' forward runs ~7 kernels per call (cast to fp32, pow, mean, add, rsqrt, mul, cast back,
× weight), each a full pass over ``[rows, D]`` in fp32: at ISL 16K and D = 2048 that is ~1 GB of HBM
traffic per norm for 64 MiB of input. Here each row is read once and written once.

Math (the reference's, step by step, so the only difference is the order of the sum of squares):
  x32 = float32(x); var = Σ x32² · (1/D) (fp32, torch's ``mean`` multiplies its sum by the reciprocal);
  r = rsqrt(var + eps) (fp32); y = round_to_input_dtype(x32 · r); out = round_to_out_dtype(float32(w) · y),
  where out dtype = ``torch.result_type(weight, x)`` (bf16 × bf16 → bf16: torch multiplies in fp32 and
  rounds once, as here). The sum is a tree within the tile instead of torch's reduction order: the output
  differs from `transformers`' by at most one rounding step where var lands on the other side of a tie
  (stated by the tests and docs/KERNELS.md; measured on the H200).

Tiling: one program normalises ``BLOCK_ROWS`` whole rows, the row held in registers as ``BLOCK_D`` (next
power of two ≥ D) columns, masked past D. ``BLOCK_ROWS`` keeps a program's tile near ``TILE_ELEMENTS``
(enough bytes in flight per SM to stream at HBM speed, few enough registers not to spill): D = 2048 → 4
rows, the per-head q/k norms (D = 128) → 64 rows per program instead of 262K one-row programs.

Invariance: the tile shape and warp count depend on D only, never on the row count, so a row's reduction
tree (and its bits) is the same alone or in any batch; no atomics, no split rows (batch invariant, and the
DWDP-sharded and unsharded models, which run the same kernel, agree bitwise).

No fused multiply-add (``enable_fp_fusion=False``): ``var + eps`` and the products round as torch's
separate kernels do (with contraction, ``Σ·(1/D) + eps`` would round once instead of twice).

Input: any tensor whose last dim is contiguous; leading dims are flattened (``reshape``: a view for the
shapes transformers passes — ``[B, L, D]`` and the ``[B, L, heads, head_dim]`` views of q/k projections).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast_out
from .support import interpreting

#: elements per program tile: 8K fp32 values = 32 KiB of registers over 8 warps (32 per thread), enough
#: loads in flight to stream a row block at HBM rate on an H200 without register spills
TILE_ELEMENTS = 8192
#: at most this many rows per program (keeps the grid ≥ a few thousand programs at serving sizes)
MAX_BLOCK_ROWS = 64
#: widest row a single-pass tile holds in registers (DeepSeek-V3 hidden 7168 → 8192 columns); wider rows
#: keep transformers' forward (the caller checks ``supports``)
MAX_D = 16384


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, num_rows, D, stride_x, stride_o, inv_d, eps,
                    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_BF16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    col_ok = cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) * inv_d
    r = tl.math.rsqrt(var + eps)
    y = cast_out(x * r[:, None], x_ptr.dtype.element_ty, EXACT_BF16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = cast_out(w[None, :] * y, out_ptr.dtype.element_ty, EXACT_BF16)
    tl.store(out_ptr + r64[:, None] * stride_o + cols[None, :], out, mask=ok)


def _tiling(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps) for rows of ``d`` elements — a function of ``d`` alone."""
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, min(MAX_BLOCK_ROWS, TILE_ELEMENTS // block_d))
    num_warps = 8 if block_d * block_rows >= TILE_ELEMENTS else 4
    return block_d, block_rows, num_warps


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel covers this call: floating input, a 1-D weight of the row length, rows ≤ ``MAX_D``."""
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and 0 < x.shape[-1] <= MAX_D
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.device == weight.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · cast(x · rsqrt(mean(x², -1) + eps))`` with `transformers`' dtypes (see module docstring)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.result_type(weight, torch.empty((), dtype=x.dtype))
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    n = rows.shape[0]
    if n:
        block_d, block_rows, num_warps = _tiling(d)
        w = weight if weight.stride(0) == 1 else weight.contiguous()
        _rmsnorm_kernel[(triton.cdiv(n, block_rows),)](
            rows, w, out, n, d, rows.stride(0), out.stride(0), 1.0 / d, float(eps),
            BLOCK_ROWS=block_rows, BLOCK_D=block_d, EXACT_BF16=interpreting(), num_warps=num_warps,
            enable_fp_fusion=False)
    return out.view(x.shape)
