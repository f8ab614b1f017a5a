"""Weight-only FP4 grouped GEMMs: the bf16 kernels of ``grouped_gemm`` with the weight tile decoded from
packed E2M1 + scales in the load (MXFP4 or NVFP4), never materialised in HBM.

Weights as DWDP binds them: packed ``w [E, N, K/2]`` uint8 (two E2M1 codes per byte, the low nibble the
even ``k``; gpt-oss's ``[E, N, K/32, 16]`` blocks are the same bytes), the projection as ``[out, in]``;
scales ``s [E, N, K/G]`` (MXFP4: E8M0 bytes, G = 32; NVFP4: e4m3 bytes, G = 16) and, NVFP4 only, the
per-projection global ``s2 [E, S]`` fp32 (gate_up's gate columns read ``s2[e, 0]``, its up columns
``s2[e, S − 1]``). Any strides; nothing is copied.

The decode of one ``[BLOCK_N, BLOCK_K]`` tile (``_fp4_tile``): load ``[BLOCK_N, BLOCK_K/2]`` bytes as they lie
(K contiguous), split the nibbles, build each E2M1 magnitude from its bits (``(1 + m/2) · 2^(e−1)``, ``m/2``
for ``e = 0``: exact), join the pair along a new last axis and flatten it onto K (``k = 2j + t``: no
transpose), and multiply each group by its scale decoded from its bits (E8M0 ``2^(s − 127)`` as the float32
bit pattern ``s << 23``; e4m3 from its sign, exponent and mantissa) — integer operations and exact products
only, so the interpreter and the GPU decode alike (no fp8 conversion, whose interpreter emulation is wrong:
docs/MODELS.md). NVFP4 then multiplies by ``s2`` (one float32 rounding) and every tile is rounded once to the
activations' dtype (``cast_out``): the tile is **exactly** ``quant.fp4``'s dequantization in that dtype.

Swapped operands: each program computes ``acc^T [BLOCK_N, BLOCK_M] = W_tile · x_tile^T``, the decoded weights
as the MMA's A operand. Hopper's wgmma reads A from registers, so the decoded tile goes from the decode
straight into the MMA; as the B operand it must be stored to shared memory first, every K step, in the warps
that also issue the MMA (that form ran at 0.07–0.10× bf16 ``_grouped_mm`` on H200, 2026-12-03). The epilogues
index the transposed accumulator (rows along its second axis). The K steps are ``grouped_gemm``'s (ascending,
BLOCK_K = 64, fp32), so the output is batch invariant for the same reasons; under the interpreter it equals
the bf16 kernels on the dequantized weights bitwise (``tests/kernels/test_fp4_kernels.py``), on the GPU within
a few bf16 ulps (the same exact products, summed by the other operand order: ``tests/gpu/test_fp4_gpu.py``).

Two decodes of the same values. The generic one (``_e2m1``/``_scale`` in float32, then ``cast_out``) runs under
the interpreter and for fp16 activations. Compiled with bf16 activations the kernels take ``_fp4_tile_fast``
(``FAST``): each byte becomes two bf16 bit patterns in one 32-bit word by integer multiplies and masks (the
codes' ``e e m`` bits at bf16 bits 8..6, e2m1 · 2^-126 exactly, subnormals included), and packed
``mul.rn.bf16x2`` by power-of-two scale factors built once per group restores the value and applies the E8M0
scale in the same exact step (NVFP4: × 2^126, × the e4m3 scale, then × ``s2`` in float32 and ``cvt.rn`` —
``quant.fp4``'s one rounding). About 7 SASS instructions per weight in the loop against 21 for the generic
decode (Triton 3.9's sm_90 build); outputs on the H200 equal the bf16 kernels on the dequantized weights
(max |diff| 0 in tests/gpu/test_fp4_gpu.py, 2026-12-04). ``DWDP_FP4_GENERIC_DECODE=1`` forces the generic
decode on the GPU (A/B measurements).

Cost: HBM reads a quarter of the bf16 weight bytes (+ 1/32 or 1/16 B of scale per weight); the decode is ALU
work in the load loop, once per row block that sweeps the tile, in the warps that issue the MMA (register-A
wgmma): the compiled tiling (``fp4_moe.FP4_TILE``) keeps two programs per SM so one decodes while the other's
MMA runs. TMA is not used for the packed tiles (the unpack needs registers anyway).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._cast import cast_out
from .grouped_gemm import _act, _block_tile, _glu, _grid, _mma, _tile_ids, glu_constexprs
from .routing import RoutingPlan
from .support import ACTIVATIONS, interpreting
from .tuning import GemmConfig

#: the scale formats (``SCALE_FMT``) and their group sizes along K
E8M0, E4M3 = 0, 1
GROUP = {E8M0: 32, E4M3: 16}


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) → float32 values, from the bits: exact."""
    sign = tl.where((code & 8) != 0, -1.0, 1.0)
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pow2 = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return sign * mag


@triton.jit
def _scale(byte, SCALE_FMT: tl.constexpr):
    """Scale bytes (int32) → float32: E8M0 ``2^(b − 127)`` or float8_e4m3fn, from the bits (exact)."""
    if SCALE_FMT == 0:
        bits = tl.where(byte == 0, 0x00400000, byte << 23)   # 2^-127 is subnormal: its own bit pattern
        return bits.to(tl.float32, bitcast=True)
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)     # subnormal: m · 2^-9
    return tl.where((byte & 0x80) != 0, -value, value)


#: E2M1 pair placement (``_FAST`` decode): byte ``b`` (two codes, the low nibble the even k) → two bf16 bit
#: patterns in one 32-bit word, each code's exponent/mantissa bits ``e e m`` at bf16 bits 8..6 and its sign at
#: bit 15 (the odd code at bits 24..22 and 31): ``((b·0x40040) & 0x01C001C0) | ((b·0x1001000) & 0x80008000)``
#: (the two shifted copies of ``b`` never overlap). Each half is then exactly ``e2m1 · 2^-126`` as a bf16 — codes
#: with ``e = 0`` land on bf16 subnormals (``0.5 · 2^-126``, ±0), which ``mul.rn.bf16x2`` keeps (PTX: subnormals
#: supported) — so multiplying by a power of two restores the value and applies a scale in the same, exact, step.
_PLACE = """
    .reg .b32 m, t;
    mul.lo.u32 m, $1, 0x40040;
    and.b32 m, m, 0x01C001C0;
    mul.lo.u32 t, $1, 0x1001000;
    and.b32 t, t, 0x80008000;
    or.b32 m, m, t;
"""
#: MXFP4: ``× F1 × F2`` with ``F1 = 2^(min(s,128) − 1)``, ``F2 = 2^(max(s,128) − 128)`` (bf16x2 splats, per group):
#: ``e2m1 · 2^-126 · 2^(s − 1) = e2m1 · 2^(s − 127)``, split in two so no factor overflows bf16; both products are
#: exact (2 significant bits, never below bf16's subnormal step)
_MX_ASM = tl.constexpr("{" + _PLACE + """
    mul.rn.bf16x2 m, m, $2;
    mul.rn.bf16x2 $0, m, $3;
}""")
#: NVFP4: ``× 2^126`` (→ e2m1 exactly), ``× s`` (the e4m3 scale as a bf16x2 splat: ≤ 6 significant bits, exact),
#: then in float32 ``× s2`` (the one rounding of ``quant.fp4``) and ``cvt.rn`` to bf16 — ``dequantize``'s value
_NV_ASM = tl.constexpr("{" + _PLACE + """
    .reg .b32 lo, hi;
    .reg .f32 a, b;
    mov.b32 t, 0x7E807E80;
    mul.rn.bf16x2 m, m, t;
    mul.rn.bf16x2 m, m, $2;
    shl.b32 lo, m, 16;
    and.b32 hi, m, 0xFFFF0000;
    mov.b32 a, lo;
    mov.b32 b, hi;
    mul.rn.f32 a, a, $3;
    mul.rn.f32 b, b, $3;
    cvt.rn.bf16x2.f32 $0, b, a;
}""")


@triton.jit
def _splat2(bits16):
    """A bf16 bit pattern (int32, 0..0xFFFF) in both halves of a 32-bit word (a bf16x2 operand)."""
    return bits16 | (bits16 << 16)


@triton.jit
def _fp4_tile_fast(packed, sb, s2, SCALE_FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   G: tl.constexpr):
    """The GPU decode (bf16 only): ``packed [BLOCK_N, BLOCK_K/2]`` bytes and ``sb [BLOCK_N, BLOCK_K/G]`` scale
    bytes (int32) → ``[BLOCK_N, BLOCK_K]`` bf16, two weights per 32-bit word through ``_MX_ASM`` / ``_NV_ASM``
    (about 4 instructions per byte for the bits, one or two packed multiplies: exactly ``_fp4_tile``'s values).
    Scale factors are built once per group and broadcast over its ``G/2`` bytes."""
    if SCALE_FMT == 0:
        f1 = _splat2((tl.minimum(sb, 128) + 126) << 7)
        f2 = _splat2((tl.maximum(sb, 128) - 1) << 7)
        f1 = tl.reshape(tl.broadcast_to(f1[:, :, None], [BLOCK_N, BLOCK_K // G, G // 2]), [BLOCK_N, BLOCK_K // 2])
        f2 = tl.reshape(tl.broadcast_to(f2[:, :, None], [BLOCK_N, BLOCK_K // G, G // 2]), [BLOCK_N, BLOCK_K // 2])
        words = tl.inline_asm_elementwise(_MX_ASM, "=r,r,r,r", [packed, f1, f2], dtype=tl.uint32, is_pure=True,
                                          pack=1)
    else:
        sf = _splat2(_scale(sb, SCALE_FMT).to(tl.uint32, bitcast=True).to(tl.int32, bitcast=True) >> 16)
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], [BLOCK_N, BLOCK_K // G, G // 2]), [BLOCK_N, BLOCK_K // 2])
        g2 = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.float32) + s2
        words = tl.inline_asm_elementwise(_NV_ASM, "=r,r,r,f", [packed, sf, g2], dtype=tl.uint32, is_pure=True,
                                          pack=1)
    lo = (words & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (words >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])


@triton.jit
def _fp4_tile(w_ptr, s_ptr, s2, expert, cols, k0, K, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
              stride_sk, dtype: tl.constexpr, SCALE_FMT: tl.constexpr, HAS_S2: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_BF16: tl.constexpr, FAST: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile (output columns ``cols`` × reduction ``[k0, k0 + BLOCK_K)``), in
    ``dtype``: the bytes are loaded ``[BLOCK_N, BLOCK_K/2]`` as they lie (K contiguous), the two nibbles of a
    byte joined along a new last axis and flattened onto K (``k = 2j + t``: no transpose, no layout change), each
    ``G``-element group multiplied by its scale through a ``[BLOCK_N, BLOCK_K/G, G]`` view. ``FAST`` (the GPU, bf16):
    the same values through ``_fp4_tile_fast``'s packed bit operations."""
    half = tl.arange(0, BLOCK_K // 2)
    w_ptrs = w_ptr + expert * stride_we + cols[:, None] * stride_wn + (k0 // 2 + half)[None, :] * stride_wk
    packed = tl.load(w_ptrs, mask=(half < (K - k0) // 2)[None, :], other=0).to(tl.int32)
    if SCALE_FMT == 0:
        G: tl.constexpr = 32
    else:
        G: tl.constexpr = 16
    groups = tl.arange(0, BLOCK_K // G)
    s_ptrs = s_ptr + expert * stride_se + cols[:, None] * stride_sn + (k0 // G + groups)[None, :] * stride_sk
    sb = tl.load(s_ptrs, mask=(k0 + groups * G < K)[None, :], other=0).to(tl.int32)
    if FAST:
        return _fp4_tile_fast(packed, sb, s2, SCALE_FMT, BLOCK_N, BLOCK_K, G)
    vals = tl.reshape(tl.join(_e2m1(packed & 15), _e2m1((packed >> 4) & 15)), [BLOCK_N, BLOCK_K])
    s = _scale(sb, SCALE_FMT)
    w = tl.reshape(tl.reshape(vals, [BLOCK_N, BLOCK_K // G, G]) * s[:, :, None], [BLOCK_N, BLOCK_K])
    if HAS_S2:
        w = w * s2
    return cast_out(w, dtype, EXACT_BF16)


@triton.jit
def fp4_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K, top_k, up_offset, col_step, s2_up,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_s2e,
    stride_be, stride_bn, stride_om,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SCALE_FMT: tl.constexpr,
    HAS_S2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, FAST: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
    ALPHA: tl.constexpr, UP_SHIFT: tl.constexpr,
):
    # swapped operands: acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] · x_tile^T — the decoded weights are
    # the MMA's A operand, which Hopper's wgmma reads from registers, so the decode never round-trips through
    # shared memory (as the B operand it must: measured 0.07-0.10x bf16 that way on H200)
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live, _, offs_n, cols = _block_tile(sorted_ptr, block_expert_ptr, pid_m, pid_n, col_step,
                                                             num_pairs, N, BLOCK_M, BLOCK_N)
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    dtype = out_ptr.dtype.element_ty
    s2_g = 1.0
    s2_u = 1.0
    if HAS_S2:
        s2_g = tl.load(s2_ptr + expert * stride_s2e)
        s2_u = tl.load(s2_ptr + expert * stride_s2e + s2_up)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a_t = tl.trans(tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0))
        g = _fp4_tile(w_ptr, s_ptr, s2_g, expert, cols, k0, K, stride_we, stride_wn, stride_wk, stride_se,
                      stride_sn, stride_sk, dtype, SCALE_FMT, HAS_S2, BLOCK_N, BLOCK_K, UPCAST, FAST)
        acc_g = _mma(g, a_t, acc_g, UPCAST)
        if HAS_GATE:
            u = _fp4_tile(w_ptr, s_ptr, s2_u, expert, cols + up_offset, k0, K, stride_we, stride_wn, stride_wk,
                          stride_se, stride_sn, stride_sk, dtype, SCALE_FMT, HAS_S2, BLOCK_N, BLOCK_K, UPCAST, FAST)
            acc_u = _mma(u, a_t, acc_u, UPCAST)
        a_ptrs += BLOCK_K * stride_xk
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc_g += tl.load(b_base + cols * stride_bn).to(tl.float32)[:, None]
        if HAS_GATE:
            acc_u += tl.load(b_base + (cols + up_offset) * stride_bn).to(tl.float32)[:, None]
    if HAS_GATE:
        act = _glu(acc_g, acc_u, ACT, CLAMP, LIMIT, ALPHA, UP_SHIFT)
    else:
        act = _act(acc_g, ACT)
    out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, cast_out(act, dtype, UPCAST), mask=offs_n[:, None] < N)


@triton.jit
def fp4_down_kernel(
    a_ptr, w_ptr, s_ptr, s2_ptr, bias_ptr, weight_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_s2e,
    stride_be, stride_bn, stride_ym,
    HAS_BIAS: tl.constexpr, SCALE_FMT: tl.constexpr, HAS_S2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, FAST: tl.constexpr,
):
    # swapped operands as in GEMM 1: acc^T [BLOCK_N, BLOCK_M]
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live, _, offs_n, cols = _block_tile(sorted_ptr, block_expert_ptr, pid_m, pid_n, 1,
                                                             num_pairs, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    dtype = y_ptr.dtype.element_ty
    s2 = 1.0
    if HAS_S2:
        s2 = tl.load(s2_ptr + expert * stride_s2e)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a_t = tl.trans(tl.load(a_ptrs, mask=k_ok[None, :], other=0.0))
        w = _fp4_tile(w_ptr, s_ptr, s2, expert, cols, k0, K, stride_we, stride_wn, stride_wk, stride_se,
                      stride_sn, stride_sk, dtype, SCALE_FMT, HAS_S2, BLOCK_N, BLOCK_K, UPCAST, FAST)
        acc = _mma(w, a_t, acc, UPCAST)
        a_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols * stride_bn).to(tl.float32)[:, None]
    route_w = tl.load(weight_ptr + pairs, mask=live, other=0.0).to(tl.float32)
    acc = acc * route_w[None, :]
    y_ptrs = y_ptr + pairs.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, cast_out(acc, dtype, UPCAST), mask=live[None, :] & (offs_n[:, None] < N))


#: interpreter-only paths, as ``grouped_gemm``'s: operands through fp32, bf16 rounding on the bits
_UPCAST = interpreting()


def _fast(x: torch.Tensor) -> bool:
    """The packed bit-operation decode (``_fp4_tile_fast``, PTX): compiled kernels with bf16 activations; the
    interpreter and fp16 take the generic decode (the same values)."""
    return not _UPCAST and x.dtype == torch.bfloat16 and not _GENERIC


#: ``DWDP_FP4_GENERIC_DECODE=1``: the generic decode on the GPU too (A/B measurements, bench/fp4_moe.py)
_GENERIC = os.environ.get("DWDP_FP4_GENERIC_DECODE", "0") not in ("", "0")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A packed or scale tensor as uint8 (float8_e4m3fn scales are read as their bits)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _packed3(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/2]`` view of packed codes (gpt-oss blocks ``[E, N, K/32, 16]`` flattened, no copy)."""
    w = _bytes(w)
    return w if w.dim() == 3 else w.flatten(2)


def _s2_args(s2: torch.Tensor | None):
    return (s2, s2.stride(0), s2.shape[1] - 1) if s2 is not None else (None, 0, 0)


def fp4_gate_up(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, s2: torch.Tensor | None, plan: RoutingPlan,
                cfg: GemmConfig, *, inter: int, up_offset: int, col_step: int, has_gate: bool, scale_fmt: int,
                bias: torch.Tensor | None = None, activation: str = "silu", glu=None) -> torch.Tensor:
    """GEMM 1 over ``plan`` from FP4 weights (``grouped_gemm.gate_up``'s contract, ``glu`` included;
    ``w [E, 2I, H/2]``)."""
    w, s = _packed3(w), _bytes(s)
    hidden = x.shape[1]
    if w.shape[2] * 2 != hidden or s.shape[2] * GROUP[scale_fmt] != hidden:
        raise ValueError(f"FP4 weights {tuple(w.shape)} / scales {tuple(s.shape)} do not fit hidden size {hidden}")
    out = torch.empty(plan.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    s2_t, s2_stride, s2_up = _s2_args(s2)
    bs = tuple(bias.stride()) if bias is not None else (0, 0)
    fp4_gate_up_kernel[_grid(plan, inter, cfg)](
        x, w, s, s2_t if s2_t is not None else s, bias if bias is not None else s, out, plan.sorted_pairs,
        plan.block_expert, plan.num_padded, plan.num_pairs, plan.max_blocks, inter, hidden, plan.top_k, up_offset,
        col_step, s2_up, x.stride(0), x.stride(1), *w.stride(), *s.stride(), s2_stride, *bs, out.stride(0),
        HAS_GATE=has_gate, HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation], SCALE_FMT=scale_fmt,
        HAS_S2=s2 is not None, BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, UPCAST=_UPCAST, FAST=_fast(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **glu_constexprs(glu))
    return out


def fp4_down(act: torch.Tensor, w: torch.Tensor, s: torch.Tensor, s2: torch.Tensor | None, weights: torch.Tensor,
             plan: RoutingPlan, cfg: GemmConfig, *, hidden: int, scale_fmt: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM 2 over ``plan`` from FP4 weights (``grouped_gemm.down``'s contract; ``w [E, H, I/2]``)."""
    w, s = _packed3(w), _bytes(s)
    inter = act.shape[1]
    if w.shape[2] * 2 != inter or s.shape[2] * GROUP[scale_fmt] != inter:
        raise ValueError(f"FP4 weights {tuple(w.shape)} / scales {tuple(s.shape)} do not fit {inter} inputs")
    y = torch.empty(plan.num_pairs, hidden, dtype=act.dtype, device=act.device)
    s2_t, s2_stride, _ = _s2_args(s2)
    bs = tuple(bias.stride()) if bias is not None else (0, 0)
    fp4_down_kernel[_grid(plan, hidden, cfg)](
        act, w, s, s2_t if s2_t is not None else s, bias if bias is not None else s, weights.reshape(-1), y,
        plan.sorted_pairs, plan.block_expert, plan.num_padded, plan.num_pairs, plan.max_blocks, hidden, inter,
        act.stride(0), *w.stride(), *s.stride(), s2_stride, *bs, y.stride(0),
        HAS_BIAS=bias is not None, SCALE_FMT=scale_fmt, HAS_S2=s2 is not None, BLOCK_M=plan.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST, FAST=_fast(act),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
