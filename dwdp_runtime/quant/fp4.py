"""FP4 (E2M1) weights with group scales: MXFP4 (E8M0 per 32) and NVFP4 (E4M3 per 16 × an fp32 global).

E2M1 codes (OCP MX spec §5.3.3): a nibble ``s e e m``; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes
0..7, codes 8..15 the same negated. **Two codes per byte, the low nibble first**: element ``2j`` of a
row is ``byte[j] & 0xF``, element ``2j + 1`` is ``byte[j] >> 4`` (gpt-oss, ModelOpt, DeepSeek-V4 and
`transformers`' ``_convert_moe_packed_tensors`` / ``_unpack_fp4`` all agree).

  MXFP4   ``q`` uint8 ``[..., N, K/2]`` (gpt-oss stores it ``[..., N, K/32, 16]``: the same bytes) and
          ``e`` uint8 ``[..., N, K/32]``, an E8M0 exponent: ``W[n, k] = e2m1(q) · 2^(e[n, k/32] − 127)``.
          Every such product is a float32 (and bfloat16) value exactly, so ``dequantize`` has one answer.
  NVFP4   ``q`` uint8 ``[..., N, K/2]``, ``s`` float8_e4m3fn ``[..., N, K/16]`` and ``s2`` float32, one per
          projection (``row_segments``: gate and up of a fused ``gate_up`` keep their own):
          ``W[n, k] = (e2m1(q) · float(s[n, k/16])) · s2`` in float32 — the first product is exact (2 × 4
          significant bits), so the one rounding is the multiplication by ``s2`` (then one to ``dtype``).

Quantizers (``mxfp4_quantize``, ``nvfp4_quantize``) write synthetic checkpoints (``dwdp-worker synth
--quant mxfp4|nvfp4``); they round to nearest, ties to the even code, and saturate at ±6 · scale:
  * MXFP4 scale exponent ``⌈log2(amax / 6)⌉`` (``triton_kernels``' ``downcast_to_mxfp`` default, the one
    gpt-oss was quantized with: the group's largest element never saturates);
  * NVFP4 as ModelOpt: ``s2 = amax(W) / (6 · 448)``, ``s = e4m3(amax(group) / 6 / s2)``.

compressed-tensors stores NVFP4's global scale inverted (``weight_global_scale`` ``g = 1 / s2``);
``nvfp4_inverse_global`` turns it into ``s2 = fl32(1 / g)``, vLLM's conversion, after which the math above
applies unchanged (``nvfp4_checkpoint``).
Torch is imported lazily (the package imports without it).
"""

from __future__ import annotations

from typing import Sequence

from .scheme import E4M3_MAX

#: E2M1 magnitudes of codes 0..7 (OCP MX spec, table 5); codes 8..15 are their negatives
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
#: the largest E2M1 magnitude
E2M1_MAX = 6.0
#: elements per scale: MXFP4 (OCP MX block), NVFP4 (NVIDIA's 16-element micro-block)
MXFP4_GROUP = 32
NVFP4_GROUP = 16
#: the E8M0 bias (2^(e − 127))
E8M0_BIAS = 127
#: midpoints between consecutive E2M1 magnitudes; a tie rounds to the even code (odd midpoints round up)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _lut(device, dtype=None):
    import torch

    return torch.tensor(E2M1_VALUES, dtype=dtype or torch.float32, device=device)


def unpack(q, dtype=None):
    """Packed codes ``[..., K/2]`` uint8 → E2M1 values ``[..., K]`` (float32, exact)."""
    import torch

    if q.dtype != torch.uint8:
        q = q.view(torch.uint8)
    lut = _lut(q.device, dtype)
    out = torch.stack((lut[(q & 0xF).long()], lut[(q >> 4).long()]), dim=-1)
    return out.reshape(*q.shape[:-1], 2 * q.shape[-1])


def pack(codes):
    """E2M1 codes ``[..., K]`` (uint8, 0..15) → bytes ``[..., K/2]``, the low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"an odd row of {codes.shape[-1]} E2M1 codes does not pack into bytes")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def encode(x):
    """float tensor (already divided by its scale) → E2M1 codes (uint8), nearest, ties to even, saturating."""
    import torch

    a = x.abs()
    code = (a > _MIDPOINTS[0]).to(torch.uint8)
    for i, mid in enumerate(_MIDPOINTS[1:], start=1):  # a tie rounds up where the upper code is even (odd i)
        code.add_((a >= mid) if i % 2 else (a > mid))
    return code | ((torch.signbit(x) & (code > 0)).to(torch.uint8) << 3)


def _groups(k: int, group: int) -> int:
    if k % group:
        raise ValueError(f"{k} columns are not a whole number of {group}-element FP4 groups")
    return k // group


# -- MXFP4 ------------------------------------------------------------------------------------------------
def mxfp4_dequantize(q, e, dtype):
    """``q [..., N, K/2]`` uint8 (or ``[..., N, K/32, 16]``), ``e [..., N, K/32]`` uint8 → ``W [..., N, K]``."""
    import torch

    e = e.view(torch.uint8) if e.dtype != torch.uint8 else e
    groups = e.shape[-1]
    q = q.reshape(*e.shape, -1)                             # [..., N, K/32, 16] either way
    vals = unpack(q)                                        # [..., N, K/32, 32]
    out = torch.ldexp(vals, (e.to(torch.int32) - E8M0_BIAS)[..., None].to(torch.float32))
    out = out.reshape(*e.shape[:-1], groups * vals.shape[-1])
    return out if dtype == torch.float32 else out.to(dtype)


def mxfp4_quantize(w):
    """``W [..., N, K]`` → ``(q uint8 [..., N, K/2], e uint8 [..., N, K/32])`` (module docstring)."""
    import torch

    n_groups = _groups(w.shape[-1], MXFP4_GROUP)
    g = w.to(torch.float32).reshape(*w.shape[:-1], n_groups, MXFP4_GROUP)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E2M1_MAX)), torch.zeros_like(amax))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = encode(torch.ldexp(g, -exp[..., None])).reshape(w.shape)
    return pack(codes), (exp + E8M0_BIAS).to(torch.uint8).contiguous()


# -- NVFP4 ------------------------------------------------------------------------------------------------
def _segments(rows: int, row_segments: Sequence[int] | None) -> tuple[int, ...]:
    segs = tuple(row_segments) if row_segments else (rows,)
    if sum(segs) != rows:
        raise ValueError(f"row segments {segs} do not add up to {rows} rows")
    return segs


def nvfp4_dequantize(q, s, s2, dtype, *, row_segments: Sequence[int] | None = None):
    """``q [..., N, K/2]``, ``s [..., N, K/16]`` e4m3, ``s2 [..., S]`` (or a scalar, S = 1) → ``W [..., N, K]``."""
    import torch

    segs = _segments(q.shape[-2], row_segments)
    vals = unpack(q)
    k = vals.shape[-1]
    if s.shape[-1] != _groups(k, NVFP4_GROUP) or s.shape[-2] != q.shape[-2]:
        raise ValueError(f"scale grid {tuple(s.shape[-2:])} does not fit a [{q.shape[-2]}, {k}] weight in "
                         f"{NVFP4_GROUP}-element groups")
    s2 = s2.to(torch.float32).reshape(*q.shape[:-2], -1) if s2.dim() else s2.to(torch.float32).reshape(1)
    if s2.shape[-1] != len(segs):
        raise ValueError(f"{s2.shape[-1]} global scales for {len(segs)} projections {segs}")
    out = vals.unflatten(-1, (k // NVFP4_GROUP, NVFP4_GROUP)).mul_(s.to(torch.float32)[..., None]).flatten(-2)
    row = 0
    for i, n in enumerate(segs):
        out[..., row:row + n, :].mul_(s2[..., i, None, None])
        row += n
    return out if dtype == torch.float32 else out.to(dtype)


def nvfp4_inverse_global(g):
    """compressed-tensors' ``weight_global_scale`` ``g`` (any shape) → ModelOpt's ``weight_scale_2``: ``1 / g``
    in float32, correctly rounded — what vLLM computes (``1.0 / weight_global_scale``) before running the
    ModelOpt-format kernels. A zero or non-finite ``g`` has no such inverse (``ValueError``)."""
    import torch

    g = g.to(torch.float32)
    bad = ~torch.isfinite(g) | (g == 0)
    if bool(bad.any()):
        raise ValueError(f"global scale {g[bad].flatten()[0].item()!r} has no finite inverse")
    return torch.reciprocal(g)


def nvfp4_quantize(w, *, row_segments: Sequence[int] | None = None):
    """``W [..., N, K]`` → ``(q uint8 [..., N, K/2], s e4m3 [..., N, K/16], s2 float32 [..., S])``."""
    import torch

    segs = _segments(w.shape[-2], row_segments)
    n_groups = _groups(w.shape[-1], NVFP4_GROUP)
    qs, ss, s2s, row = [], [], [], 0
    for n in segs:
        part = w[..., row:row + n, :].to(torch.float32)
        row += n
        amax = part.abs().amax(dim=(-2, -1))
        s2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
        g = part.reshape(*part.shape[:-1], n_groups, NVFP4_GROUP)
        gs = (g.abs().amax(dim=-1) / E2M1_MAX / s2[..., None, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        denom = gs.to(torch.float32) * s2[..., None, None]
        scaled = torch.where(denom[..., None] > 0, g / denom[..., None], torch.zeros_like(g))
        qs.append(pack(encode(scaled).reshape(part.shape)))
        ss.append(gs)
        s2s.append(s2)
    return (torch.cat(qs, dim=-2).contiguous(), torch.cat(ss, dim=-2).contiguous(),
            torch.stack(s2s, dim=-1).contiguous())
