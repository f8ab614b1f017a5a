"""W4A8's weight step: packed FP4 experts → e4m3 with 128×128 block scales, the operands of the FP8 kernels.

``fp4_block_fp8(packed, scales, fmt, scale_2, split)`` re-encodes one projection of all experts as DWDP binds
it (``[E, N, K/2]`` codes, ``[E, N, K/G]`` group scales, NVFP4's ``[E, S]`` globals, any strides; the composite
the prefetch filled) into ``w [E, N, K]`` float8_e4m3fn and ``s [E, N/128, K/128]`` float32 — exactly the
layout ``quant.fp8_block`` checkpoints have and the CuTe / Triton block-scaled grouped GEMMs read
(``fp8_moe.fp8_moe_forward``). The page pool keeps the FP4 bytes: the prefetch moves a quarter of bf16 and
the e4m3 copy lives for one layer's forward (the caching allocator's block, reused layer after layer).

One program per ``(expert, 128-row block, 128-column block)``, in one pass over the weights:

  the block's largest group scale ``s_max`` (its 128 × 128/G scale bytes) → ``k``, the smallest integer with
  ``6 · s_max ≤ 448 · 2^k`` (6 is E2M1's largest magnitude; from the float's bits: exact, floored at −126) →
  per 32-row tile: decode E2M1 × group scale (exact; NVFP4 without its global ``s2``) → ``q = v · 2^-k`` (two
  exact power-of-two factors) → e4m3 round-to-nearest-even → the block scale ``2^k · s2`` (NVFP4: the global
  of the block's rows — gate and up blocks each take theirs — exact) or ``2^k``.

Why a power-of-two block scale: dividing by it is exact, so the only rounding is e4m3's own, and for MXFP4 the
re-encoding is **lossless** wherever it can be: an E2M1 code times ``2^(e_g − k)`` (``e_g`` its group's E8M0
exponent, ``k = e_max − 6``) is an e4m3 value while ``e_g − k ≥ −8`` (0.5 · 2^-8 is e4m3's smallest subnormal,
2^-9): every group within 14 binades of the block's largest is exact, smaller ones round (``exactness``: how
many weights did). NVFP4 keeps its global in the block scale, so what is re-encoded is E2M1 × the e4m3 group
scale: codes ±0.5, 1, 2, 4 give 4 significant bits (exact, same range rule), codes ±1.5, 3, 6 give up to 5 and
round to e4m3's 4 when the scale's last mantissa bit is set (≤ 2^-5 relative); the model-level agreement bench
measures what that costs (docs/KERNELS.md).

Two paths to the same bytes. On the GPU (``FAST``): the weight-only kernels' packed bf16 decode
(``_fp4_tile_fast``: a few integer ops per byte) and the hardware e4m3 conversion. Under the interpreter: the
float32 decode and the encode as integer arithmetic on the float32 bits (``_e4m3_bits``), since the interpreter's
fp8 conversion rounds ties away and flushes subnormals (docs/MODELS.md). Both equal torch's own
``.to(torch.float8_e4m3fn)`` of the same quotient (``fp4_fp8_reference``; tested on CPU and GPU).

Why the block scale comes from the scales and not from the decoded values' amax: it needs no second pass (the
first version took the block's amax, decoding every block twice over, and ran at 0.37–0.39 TB/s on an H100 —
2.5 ms for a Qwen3-30B layer, longer than the GEMMs it feeds); the bound costs at most the headroom between the
block's largest code and 6.

Cost on the GPU: reads 0.53 (MXFP4) / 0.56 (NVFP4) B and writes 1 B per weight, memory bound (bench/fp4_moe.py
prints its time beside the GEMMs').
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant.scheme import E4M3_MAX, FP8_SCALE_BLOCK
from .fp4_grouped_gemm import E4M3, E8M0, _bytes, _fp4_tile, _scale
from .support import interpreting

log = logging.getLogger(__name__)

#: e4m3fn's largest finite code (0x7E = 1.75 · 2^8), where an over-range value saturates
_E4M3_MAX_CODE = tl.constexpr(0x7E)
#: float32 exponent field of e4m3's smallest normal, 2^-6 (127 − 6): below it e4m3 is subnormal
_E4M3_MIN_NORMAL_EXP = tl.constexpr(121)
#: mantissa bits of E4M3_MAX = 448 (1.75) in float32: ``amax`` above 1.75 · 2^j needs the next power of two
_MANT_448 = tl.constexpr(0x600000)
#: the block scale's exponent floor: 2^-126, float32's smallest normal (a block of zeros or of float32
#: subnormals takes it; its codes are then exact or 0)
_MIN_SCALE_EXP = -126
_MIN_SCALE_EXP_C = tl.constexpr(_MIN_SCALE_EXP)
#: rows of a block decoded and encoded at once on the GPU: a [32, 128] tile keeps 32 values per thread at 4 warps
#: (the interpreter takes the whole block: its cost is per operation, not per value)
SUB_ROWS = 32


@triton.jit
def _pow2(e):
    """``2^e`` as float32 for integer ``e`` in [-126, 127], from the bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(q):
    """float32 ``q`` (|q| ≤ 448 up to rounding) → float8_e4m3fn codes (int32, 0..255): round to nearest even,
    subnormals kept, saturating at ±448 — from the bits, identical on the GPU and in the interpreter."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    mant = mag & 0x7FFFFF
    r = mant >> 20
    rem = mant & 0xFFFFF
    up = ((rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))).to(tl.int32)
    normal = (((exp - 120) << 3) | r) + up
    # subnormal: the magnitude in units of 2^-9 (exact in float32), its integer part, ties to even
    units = mag.to(tl.float32, bitcast=True) * 512.0
    whole = units.to(tl.int32)
    frac = units - whole.to(tl.float32)
    sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    code = tl.where(exp >= _E4M3_MIN_NORMAL_EXP, normal, sub)
    return tl.minimum(code, _E4M3_MAX_CODE) | sign


@triton.jit
def _fp4_fp8_kernel(w_ptr, s_ptr, s2_ptr, q_ptr, qs_ptr, N, K, split, s2_second,
                    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_s2e, stride_s2s,
                    stride_qe, stride_qn, stride_qse, stride_qsn,
                    SCALE_FMT: tl.constexpr, HAS_S2: tl.constexpr, BLOCK_: tl.constexpr, SUB: tl.constexpr,
                    FAST: tl.constexpr):
    # 64-bit expert offsets: a layer's e4m3 experts pass 2^31 bytes (DeepSeek-R1: 256 × 29.4 MB of gate_up)
    expert = tl.program_id(0).to(tl.int64)
    row_block = tl.program_id(1)
    col_block = tl.program_id(2)
    k0 = col_block * BLOCK_
    if SCALE_FMT == 0:
        G: tl.constexpr = 32
    else:
        G: tl.constexpr = 16
    # the block scale from the group scales alone (one pass over the weights): the largest |E2M1| is 6, so
    # 6 · (the block's largest group scale) bounds every value; k is the smallest integer with bound ≤ 448 · 2^k
    # a ragged last block (N or K not a multiple of 128: gpt-oss's 2880) reads no scale past the edge: a missing
    # scale byte is 0, the smallest of either format, so the block's largest is its real groups' largest
    srows = row_block * BLOCK_ + tl.arange(0, BLOCK_)
    sgroups = col_block * (BLOCK_ // G) + tl.arange(0, BLOCK_ // G)
    s_ok = (srows < N)[:, None] & (sgroups * G < K)[None, :]
    sb = tl.load(s_ptr + expert * stride_se + srows[:, None] * stride_sn + sgroups[None, :] * stride_sk,
                 mask=s_ok, other=0).to(tl.int32)
    if SCALE_FMT == 1:
        sb = sb & 0x7F     # e4m3: the magnitude (NVFP4 scales are positive; a stray sign bit is harmless)
    largest = tl.max(tl.max(sb, axis=1), axis=0)   # for non-negative codes, byte order is value order
    bound = 6.0 * _scale(largest, SCALE_FMT)
    bits = bound.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > _MANT_448).to(tl.int32)
    k = tl.maximum(k, _MIN_SCALE_EXP_C)
    half = (-k) // 2
    down1 = _pow2(half)
    down2 = _pow2(-k - half)
    factor = 1.0
    if HAS_S2:  # NVFP4: the gate rows' global (s2[e, 0]) or the up rows' (s2[e, S - 1]) goes into the block scale
        second = tl.where(row_block * BLOCK_ >= split, s2_second, 0)
        factor = tl.load(s2_ptr + expert * stride_s2e + second * stride_s2s)
    cols = k0 + tl.arange(0, BLOCK_)
    for r0 in range(0, BLOCK_, SUB):   # SUB rows at a time: a [SUB, 128] tile in registers
        rows = row_block * BLOCK_ + r0 + tl.arange(0, SUB)
        rows_in = tl.minimum(rows, N - 1)   # a ragged block's missing rows read the last row; never stored
        if FAST:   # the GPU: the packed bf16 decode (exact: E2M1 × group scale), the hardware e4m3 conversion
            v = _fp4_tile(w_ptr, s_ptr, 1.0, expert, rows_in, k0, K, stride_we, stride_wn, stride_wk, stride_se,
                          stride_sn, stride_sk, tl.bfloat16, SCALE_FMT, False, SUB, BLOCK_, False, True)
            q = v.to(tl.float32) * down1 * down2
            codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:      # the interpreter: the float32 decode, the encode on the bits (its fp8 conversion is wrong)
            v = _fp4_tile(w_ptr, s_ptr, 1.0, expert, rows_in, k0, K, stride_we, stride_wn, stride_wk, stride_se,
                          stride_sn, stride_sk, tl.float32, SCALE_FMT, False, SUB, BLOCK_, False, False)
            codes = _e4m3_bits(v * down1 * down2).to(tl.uint8)
        tl.store(q_ptr + expert * stride_qe + rows[:, None] * stride_qn + cols[None, :], codes,
                 mask=(rows < N)[:, None] & (cols < K)[None, :])
    tl.store(qs_ptr + expert * stride_qse + row_block * stride_qsn + col_block, _pow2(k) * factor)


SCALE_FORMATS = {"mxfp4": E8M0, "fp4-ue8m0": E8M0, "nvfp4": E4M3}


def unpacked_columns(packed: torch.Tensor) -> int:
    """The in-features K of packed FP4 ``[E, N, K/2]`` codes (or gpt-oss's ``[E, N, K/32, 16]`` blocks)."""
    return packed.shape[2] * (2 if packed.dim() == 3 else 32)


def scale_grid(n: int, k: int) -> tuple[int, int]:
    """The 128×128 block-scale grid of an ``[N, K]`` projection: a ragged edge is a block of its own."""
    return -(-n // FP8_SCALE_BLOCK), -(-k // FP8_SCALE_BLOCK)


def fp4_block_fp8(packed: torch.Tensor, scales: torch.Tensor, fmt: str, scale_2: torch.Tensor | None = None, *,
                  split: int | None = None, sub_rows: int | None = None, fast: bool | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [E, N, K] float8_e4m3fn, s [E, ⌈N/128⌉, ⌈K/128⌉] float32)`` from packed FP4 ``[E, N, K/2]`` (or
    gpt-oss's ``[E, N, K/32, 16]`` blocks) and group scales ``[E, N, K/G]``, any strides (a ragged last block —
    gpt-oss's 2880 — is scaled by its own groups); NVFP4's ``scale_2 [E, S]``, whose second column applies from
    row ``split`` on (a fused ``[gate; up]``, ``split`` a multiple of 128). ``sub_rows``: rows per tile (a divisor
    of 128; default ``SUB_ROWS`` on the GPU, the whole block in the interpreter) — the bytes do not depend on it.
    ``fast``: the GPU decode (default: where ``self_check`` found it right). ``out``: the ``(w, s)`` to write, of
    the shapes above with unit stride in their last dimension (views of a larger buffer allowed:
    ``gate_up_block_fp8`` writes the two halves of one). Values: module docstring."""
    if fmt not in SCALE_FORMATS:
        raise ValueError(f"FP4 format {fmt!r}: one of {sorted(SCALE_FORMATS)}")
    num_experts, n, k = packed.shape[0], packed.shape[1], unpacked_columns(packed)
    if packed.dim() == 4:
        packed = packed.flatten(2)
    # DeepSeek-V4 stores its codes as int8: read as bytes, or the GPU decode's bit arithmetic would see the
    # sign-extended high nibble (the interpreter's nibble masks hide it)
    packed = _bytes(packed)
    fmt_code = SCALE_FORMATS[fmt]
    has_s2 = fmt_code == E4M3 and scale_2 is not None
    sub = sub_rows or (FP8_SCALE_BLOCK if interpreting() else SUB_ROWS)
    if FP8_SCALE_BLOCK % sub:
        raise ValueError(f"sub_rows={sub_rows} does not divide the {FP8_SCALE_BLOCK}-row block")
    if split is not None and split % FP8_SCALE_BLOCK:
        raise ValueError(f"the second global scale starts at row {split}, inside a {FP8_SCALE_BLOCK}-row block")
    if fast is None:
        fast = not interpreting() and (packed.device.type != "cuda" or self_check(packed.device).fast)
    grid = (num_experts, *scale_grid(n, k))
    shapes = ((num_experts, n, k), grid)
    if out is None:
        w = torch.empty(shapes[0], dtype=torch.float8_e4m3fn, device=packed.device)
        s = torch.empty(shapes[1], dtype=torch.float32, device=packed.device)
    else:
        w, s = out
        if (tuple(w.shape), tuple(s.shape)) != shapes or w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 \
                or w.stride(2) != 1 or s.stride(2) != 1:
            raise ValueError(f"out must be float8_e4m3fn {shapes[0]} and float32 {shapes[1]} tensors with unit "
                             f"stride in their last dimension")
    codes = w.view(torch.uint8)
    s2 = scale_2 if has_s2 else s
    _fp4_fp8_kernel[grid](
        packed, scales.view(torch.uint8), s2, codes, s, n, k, n if split is None else split,
        (s2.shape[1] - 1) if has_s2 else 0,
        packed.stride(0), packed.stride(1), packed.stride(2), scales.stride(0), scales.stride(1), scales.stride(2),
        s2.stride(0) if has_s2 else 0, s2.stride(1) if has_s2 else 0, codes.stride(0), codes.stride(1), s.stride(0),
        s.stride(1),
        SCALE_FMT=fmt_code, HAS_S2=has_s2, BLOCK_=FP8_SCALE_BLOCK, SUB=sub, FAST=fast and not interpreting())
    return w, s


def gate_up_block_fp8(packed: torch.Tensor, scales: torch.Tensor, fmt: str, scale_2: torch.Tensor | None = None, *,
                      inter: int, interleaved: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1's operands: ``(w [E, 2I, K], s [E, 2·⌈I/128⌉, ⌈K/128⌉])`` with the gate rows first and the up rows
    after, each half in blocks of its own (the FP8 kernels read the up half's scales from row ⌈I/128⌉) —
    whatever the checkpoint's row order: ``[gate; up]`` halves, or (``interleaved``) gpt-oss's alternating
    gate/up rows, read through stride-2 views (the re-encoding writes them apart; nothing else is copied).
    NVFP4's gate global is ``scale_2[:, 0]``, the up global ``scale_2[:, -1]``."""
    num_experts, k = packed.shape[0], unpacked_columns(packed)
    if packed.shape[1] != 2 * inter:
        raise ValueError(f"gate_up rows {packed.shape[1]} are not 2 × {inter}")
    halves = ((slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, inter), slice(inter, None)))
    row_blocks, col_blocks = scale_grid(inter, k)
    if out is None:
        out = (torch.empty(num_experts, 2 * inter, k, dtype=torch.float8_e4m3fn, device=packed.device),
               torch.empty(num_experts, 2 * row_blocks, col_blocks, dtype=torch.float32, device=packed.device))
    w, s = out
    globals_ = (None, None) if scale_2 is None else (scale_2[:, :1], scale_2[:, -1:])
    for half, (rows, g2) in enumerate(zip(halves, globals_)):
        fp4_block_fp8(packed[:, rows], scales[:, rows], fmt, g2,
                      out=(w[:, half * inter:(half + 1) * inter], s[:, half * row_blocks:(half + 1) * row_blocks]))
    return w, s


@dataclass(frozen=True)
class SelfCheck:
    """What ``self_check`` found on one GPU: the decode that writes torch's bytes (``fast`` first), or why none."""

    fast: bool = False
    unusable: str | None = None


#: the check's experts: 2 experts × 256 rows × 128 columns — two row blocks (gate and up: NVFP4's two globals)
_CHECK_SHAPE = (2, 256, 128)


def self_check(device) -> SelfCheck:
    """Whether the compiled re-encoding writes torch's own bytes on this GPU (once per process and device, at the
    first W4A8 forward — the warm-up, before any CUDA graph is captured): seeded random codes and scales of both
    formats, every code and a spread of scale bytes, against ``fp4_fp8_reference`` computed by torch on the same
    device (its hardware conversion). The GPU decode first, then the generic one; where neither matches, W4A8
    is unusable here and ``w4a8_moe`` serves weight-only, naming the reason."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if torch.cuda.is_current_stream_capturing() and _self_check.cache_info().currsize == 0:
        # its host-to-device copies cannot be captured; the warm-up forwards are eager, so this means a capture
        # came first: fail it (the graph layer falls back to eager, whose forward runs the check)
        raise RuntimeError("the W4A8 re-encoding's self-check must run before any CUDA graph capture")
    return _self_check(index)


@functools.cache
def _self_check(index: int) -> SelfCheck:
    return run_self_check(torch.device("cuda", index))


def run_self_check(device: torch.device) -> SelfCheck:
    """``self_check``'s work on ``device``, uncached (the CPU tests run it under the interpreter)."""
    from ..quant import fp4

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    gen = torch.Generator().manual_seed(0)
    e, n, k = _CHECK_SHAPE
    cases = []
    for fmt in ("mxfp4", "nvfp4"):
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        if fmt == "mxfp4":
            scales, s2 = torch.randint(100, 140, (e, n, k // 32), generator=gen, dtype=torch.uint8), None
            values = fp4.mxfp4_dequantize(packed, scales, torch.float32)
        else:
            scales = torch.randint(1, 0x7F, (e, n, k // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
            s2 = torch.rand(e, 2, generator=gen) + 0.5
            values = fp4.nvfp4_dequantize(packed, scales, torch.ones_like(s2), torch.float32, row_segments=(n // 2,) * 2)
        factor = None if s2 is None else torch.where(torch.arange(0, n, FP8_SCALE_BLOCK)[None, :] >= n // 2, s2[:, -1:], s2[:, :1])
        want = fp4_fp8_reference(values.to(device), block_bound(scales, fmt).to(device),
                                 None if factor is None else factor.to(device))
        cases.append((fmt, packed.to(device), scales.to(device), None if s2 is None else s2.to(device), want))
    failures = []
    for fast in (True, False):
        bad = [fmt for fmt, packed, scales, s2, (w, s) in cases
               if not _same(fp4_block_fp8(packed, scales, fmt, s2, split=n // 2, fast=fast), (w, s))]
        if not bad:
            if failures:
                log.warning("W4A8 re-encoding: the GPU decode differs from torch on %s (%s); using the generic one",
                            name, ", ".join(failures))
            return SelfCheck(fast=fast)
        failures.append(f"{'GPU' if fast else 'generic'} decode: {', '.join(bad)}")
    why = f"the W4A8 re-encoding differs from torch's on {name} ({'; '.join(failures)})"
    log.error("%s: FP4 experts serve weight-only", why)
    return SelfCheck(unusable=why)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def block_bound(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[E, ⌈N/128⌉, ⌈K/128⌉]`` float32: 6 × the largest group-scale magnitude of each 128×128 block (what the
    kernel derives its block scale from) — ``scales [E, N, K/G]`` as the loaders bind them (E8M0 bytes, e4m3); a
    ragged block's missing groups count as the zero byte, as in the kernel."""
    if fmt not in SCALE_FORMATS:
        raise ValueError(f"FP4 format {fmt!r}: one of {sorted(SCALE_FORMATS)}")
    group = 32 if SCALE_FORMATS[fmt] == E8M0 else 16
    raw = scales.contiguous().view(torch.uint8)
    rows, cols = scale_grid(raw.shape[1], raw.shape[2] * group)
    raw = _zero_padded(raw, rows * FP8_SCALE_BLOCK, cols * (FP8_SCALE_BLOCK // group))
    if SCALE_FORMATS[fmt] == E8M0:
        value = torch.ldexp(torch.ones_like(raw, dtype=torch.float32), raw.to(torch.int32) - 127)
    else:
        value = (raw & 0x7F).view(torch.float8_e4m3fn).float()
    e, n, groups = value.shape
    blocks = value.reshape(e, n // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK, groups // (FP8_SCALE_BLOCK // group), FP8_SCALE_BLOCK // group)
    return 6.0 * blocks.amax(dim=(2, 4))


def fp4_fp8_reference(values: torch.Tensor, bound: torch.Tensor,
                      factor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's re-encoding in torch (the tests' oracle): ``values [E, N, K]`` float32 are the decoded
    weights before NVFP4's global (``quant.fp4``'s dequantization with ``s2 = 1``: exact), ``bound`` the blocks'
    ``block_bound``, ``factor [E, N/128]`` the global of each row block (None: 1). Per 128×128 block
    ``k = ⌈log2(bound / 448)⌉`` (floored at −126), ``w = (v · 2^-k).to(float8_e4m3fn)``, ``s = 2^k · factor``."""
    e, n, k = values.shape
    rows, cols = scale_grid(n, k)
    blocks = _zero_padded(values, rows * FP8_SCALE_BLOCK, cols * FP8_SCALE_BLOCK).reshape(e, rows, FP8_SCALE_BLOCK, cols, FP8_SCALE_BLOCK).float()
    mant, exp = torch.frexp(bound.float())                                # bound = mant · 2^exp, mant ∈ [0.5, 1)
    kexp = (exp - 9 + (mant > E4M3_MAX / 512).to(exp.dtype)).clamp(min=_MIN_SCALE_EXP)
    kexp = torch.where(bound == 0, torch.full_like(kexp, _MIN_SCALE_EXP), kexp)
    scale = torch.ldexp(torch.ones_like(bound, dtype=torch.float32), kexp)
    if factor is not None:
        scale = scale * factor[:, :, None]
    q = torch.ldexp(blocks, -kexp[:, :, None, :, None])
    return q.to(torch.float8_e4m3fn).reshape(e, rows * FP8_SCALE_BLOCK, cols * FP8_SCALE_BLOCK)[:, :n, :k].contiguous(), scale


def _zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t [E, n, k]`` with zeros appended up to ``[E, rows, cols]``."""
    return torch.nn.functional.pad(t, (0, cols - t.shape[2], 0, rows - t.shape[1]))


def exactness(values: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> float:
    """Fraction of the weights whose re-encoded value ``w · s`` equals ``values`` exactly (both as
    ``fp4_fp8_reference`` takes them: before NVFP4's global, so ``s`` without it)."""
    e, n, k = w.shape
    rows, cols = scale_grid(n, k)
    back = (_zero_padded(w.float(), rows * FP8_SCALE_BLOCK, cols * FP8_SCALE_BLOCK).reshape(e, rows, FP8_SCALE_BLOCK, cols, FP8_SCALE_BLOCK)
            * s[:, :, None, :, None]).reshape(e, rows * FP8_SCALE_BLOCK, cols * FP8_SCALE_BLOCK)[:, :n, :k]
    return float((back == values.float()).float().mean())
