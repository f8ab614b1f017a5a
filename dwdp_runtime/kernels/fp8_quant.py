"""FP8 e4m3 activation quantization, per token and 128-column group, on the fly (dynamic scales).

``quantize_groups(x [T, K])`` → ``(q float8_e4m3fn [T, K], s float32 [T, ⌈K/128⌉])`` with, per row and group g,
``s = amax(|x[t, g]|) / 448`` (1 for an all-zero group) and ``q = e4m3(x / s)`` rounded to nearest even — the
dynamic activation scheme of DeepSeek-V3 (``activation_scheme: dynamic``, 1×128 groups) that the block-scaled
GEMMs (``fp8_grouped_gemm``) consume; their GEMM 1 epilogue applies the same rule to its output tile.

``to_e4m3(x, EMULATE)``: fp32 → e4m3, round-to-nearest-even, saturating at ±448. On the GPU it is the
hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``). Triton's CPU interpreter (seen with triton 3.9)
rounds fp32 → fp8 ties away from zero, flushes e4m3 subnormals to zero and does not saturate; under the
interpreter (``EMULATE``) the value is rounded on its fp32 bits first (3 mantissa bits kept, RNE; below
2^-6 the subnormal grid of 2^-9, RNE through the 1.5·2^23 magic constant, sign of zero kept), so the conversion that follows is
exact and CPU tests see the GPU's numbers. The interpreter's fp8 → fp32 conversion is exact for every finite
code, and its ``tl.dot`` on fp8 operands is wrong, so the GEMMs widen fp8 operands to fp32 under it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.scheme import E4M3_MAX, FP8_SCALE_BLOCK
from . import interpreting

#: E4M3_MAX as a constant the kernels below can read
_E4M3_MAX = tl.constexpr(E4M3_MAX)
#: rows per program of the quantization kernel
BLOCK_T = 16


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        sub = tl.where(sub == 0.0, x * 0.0, sub)  # keep the sign of a value that rounds to zero
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def scaled(x, s):
    """``x / s`` correctly rounded (``div.rn``): Triton's ``/`` on fp32 compiles to the approximate ``div.full``
    on NVIDIA GPUs, which moved e4m3 rounding ties off torch's (measured on H200: activations not bitwise)."""
    return tl.math.div_rn(x, s)


@triton.jit
def group_scale(amax):
    """Per-group scale from the group's amax (fp32): amax / 448, or 1 for an all-zero group."""
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32)), 1.0)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
                  BLOCK_T: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows[:, None] < T) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = group_scale(tl.max(tl.abs(x), axis=1))
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], to_e4m3(scaled(x, s[:, None]), EMULATE), mask=ok)
    tl.store(s_ptr + r64 * stride_s + g, s, mask=rows < T)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` (any float dtype, unit stride in K) → ``(q [T, K] e4m3, s [T, ⌈K/128⌉] fp32)``."""
    if x.dim() != 2:
        raise ValueError(f"quantize_groups expects [tokens, K], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    groups = triton.cdiv(k, FP8_SCALE_BLOCK)
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    if t:
        _quant_kernel[(triton.cdiv(t, BLOCK_T), groups)](x, q, s, t, k, x.stride(0), q.stride(0), s.stride(0),
                                                        BLOCK_T=BLOCK_T, GROUP=FP8_SCALE_BLOCK, EMULATE=interpreting())
    return q, s


def quantize_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization in torch (tests and the CPU reference of the FP8 GEMMs)."""
    t, k = x.shape
    groups = -(-k // FP8_SCALE_BLOCK)
    xf = torch.zeros(t, groups * FP8_SCALE_BLOCK, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.to(torch.float32)
    tiles = xf.view(t, groups, FP8_SCALE_BLOCK)
    amax = tiles.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(t, -1)[:, :k]
    return q.contiguous(), s
