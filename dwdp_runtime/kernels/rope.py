"""Rotary position embedding of q and k in one launch, bitwise `transformers`' ``apply_rotary_pos_emb``.

`transformers` (Qwen3-MoE, Mixtral, DeepSeek-V3 with ``rope_interleave=False``; 5.17 and 5.24 alike):
``q·cos + rotate_half(q)·sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` — five
elementwise kernels per tensor (mul, neg, cat, mul, add), each a full pass over ``[B, heads, L, D]``.

Here one program handles one token position (b, l): it loads that position's ``cos``/``sin`` rows once and
rotates every q head and every k head, reading each element once and writing it once. The math keeps the
reference's roundings, element by element: ``a = rnd(x·cos)``, ``b = rnd(rot·sin)`` (``rot`` = ∓ the
other half, negation exact), ``out = rnd(a + b)`` where ``rnd`` rounds fp32 to the tensors' dtype (as torch's
bf16 ops do: compute in fp32, round once per op). No reduction, and no fused multiply-add
(``enable_fp_fusion=False``; for fp32 tensors ``a + b`` would otherwise contract into one FMA):
**bitwise equal** to `transformers` (tested), so swapping it in changes no number anywhere.

Tiling: ``[BLOCK_H heads, D/2]`` per half; heads beyond the count masked. Strides are free (the q/k that
transformers passes are ``[B, L, heads, D]`` projections viewed as ``[B, heads, L, D]``; DeepSeek-V3's
rope parts are slices); only the last dim must be contiguous. Outputs take the inputs' memory layout
(``empty_like``, as torch's elementwise ops do), so the attention kernel sees the same strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast_out
from .support import interpreting

#: head dims the kernel covers (even, a power of two per half so a half is one tl.arange)
HEAD_DIMS = (32, 64, 128, 256)


@triton.jit
def _rotate(x_ptr, o_ptr, b, l, heads, sxb, sxh, sxl, sob, soh, sol, c1, c2, s1, s2,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, EXACT_BF16: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    ok = (h < heads)[:, None]
    base = x_ptr + b.to(tl.int64) * sxb + l.to(tl.int64) * sxl + h[:, None].to(tl.int64) * sxh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dt = o_ptr.dtype.element_ty
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # first half: x1·cos1 + (-x2)·sin1; second half: x2·cos2 + x1·sin2 (each product rounded, then the sum)
    a1 = cast_out(f1 * c1[None, :], dt, EXACT_BF16).to(tl.float32)
    b1 = cast_out(-f2 * s1[None, :], dt, EXACT_BF16).to(tl.float32)
    a2 = cast_out(f2 * c2[None, :], dt, EXACT_BF16).to(tl.float32)
    b2 = cast_out(f1 * s2[None, :], dt, EXACT_BF16).to(tl.float32)
    obase = o_ptr + b.to(tl.int64) * sob + l.to(tl.int64) * sol + h[:, None].to(tl.int64) * soh + d[None, :]
    tl.store(obase, cast_out(a1 + b1, dt, EXACT_BF16), mask=ok)
    tl.store(obase + HALF, cast_out(a2 + b2, dt, EXACT_BF16), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, L, q_heads, k_heads,
                 sqb, sqh, sql, skb, skh, skl, sqob, sqoh, sqol, skob, skoh, skol, scb, scl, ssb, ssl,
                 HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, EXACT_BF16: tl.constexpr):
    pos = tl.program_id(0)
    b = pos // L
    l = pos % L
    d = tl.arange(0, HALF)
    cb = cos_ptr + b.to(tl.int64) * scb + l.to(tl.int64) * scl
    sb = sin_ptr + b.to(tl.int64) * ssb + l.to(tl.int64) * ssl
    c1 = tl.load(cb + d).to(tl.float32)
    c2 = tl.load(cb + HALF + d).to(tl.float32)
    s1 = tl.load(sb + d).to(tl.float32)
    s2 = tl.load(sb + HALF + d).to(tl.float32)
    _rotate(q_ptr, qo_ptr, b, l, q_heads, sqb, sqh, sql, sqob, sqoh, sqol, c1, c2, s1, s2,
            HALF, BLOCK_QH, EXACT_BF16)
    _rotate(k_ptr, ko_ptr, b, l, k_heads, skb, skh, skl, skob, skoh, skol, c1, c2, s1, s2,
            HALF, BLOCK_KH, EXACT_BF16)


def supports(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """The kernel covers this call: ``[B, heads, L, D]`` q/k, ``[B or 1, L, D]`` cos/sin, heads at dim 1
    (``unsqueeze_dim == 1``), one 16/32-bit float dtype for all four (no type promotion), D in ``HEAD_DIMS``,
    last dims contiguous, all on one device."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    dtypes = {q.dtype, k.dtype, cos.dtype, sin.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    b, _, length, d = q.shape
    if d not in HEAD_DIMS or k.shape[0] != b or k.shape[2] != length or k.shape[3] != d:
        return False
    for t in (cos, sin):
        if t.shape[1:] != (length, d) or t.shape[0] not in (1, b) or t.stride(-1) != 1:
            return False
    return (q.stride(-1) == 1 and k.stride(-1) == 1
            and len({q.device, k.device, cos.device, sin.device}) == 1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q_embed, k_embed) = transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``supports`` holds)."""
    b, q_heads, length, d = q.shape
    k_heads = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return qo, ko
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    block_q, block_k = triton.next_power_of_2(q_heads), triton.next_power_of_2(k_heads)
    _rope_kernel[(b * length,)](
        q, k, cos, sin, qo, ko, length, q_heads, k_heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cb, cos.stride(1), sb, sin.stride(1),
        HALF=d // 2, BLOCK_QH=block_q, BLOCK_KH=block_k, EXACT_BF16=interpreting(),
        num_warps=4 if block_q * d <= 2048 else 8, enable_fp_fusion=False)
    return qo, ko
