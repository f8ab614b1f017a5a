"""FP8 e4m3 with 128×128 block scales: quantize (synthetic checkpoints) and dequantize (CPU reference, load).

Convention (DeepSeek-V3 ``weight_scale_inv``, `transformers` ``FineGrainedFP8``): for a weight ``W [..., N, K]``
and block ``(bn, bk)``, block ``(i, j)`` covers rows ``[i·bn, (i+1)·bn)`` and columns ``[j·bk, (j+1)·bk)`` (the
last block of each dim may be partial); ``scale_inv[i, j] = amax(|block|) / 448`` (1 for an all-zero block) and
``W ≈ float(q) · scale_inv``. A fused parameter built from several projections (``gate_up = cat(gate, up)``)
is quantized per projection (``row_segments``), exactly as the per-projection checkpoint tensors are, and its
scale rows are the concatenation of theirs.

``dequantize`` is the one definition of "the dequantized weight": the CPU reference model, the DWDP CPU
experts path and load-time dequantization of dense FP8 linears all call it, so they agree bitwise
(``float(q) · scale`` in float32, then one rounding to the compute dtype).
"""

from __future__ import annotations

from typing import Sequence

from .scheme import E4M3_MAX, FP8_BLOCK, ceil_div


def _segments(rows: int, row_segments: Sequence[int] | None) -> tuple[int, ...]:
    segs = tuple(row_segments) if row_segments else (rows,)
    if sum(segs) != rows:
        raise ValueError(f"row segments {segs} do not add up to {rows} rows")
    return segs


def _quantize_one(w, block):
    import torch

    bn, bk = block
    n, k = w.shape[-2:]
    lead = w.shape[:-2]
    pn, pk = ceil_div(n, bn) * bn, ceil_div(k, bk) * bk
    wf = torch.zeros(*lead, pn, pk, dtype=torch.float32, device=w.device)
    wf[..., :n, :k] = w.to(torch.float32)
    tiles = wf.reshape(*lead, pn // bn, bn, pk // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.reshape(*lead, pn, pk)[..., :n, :k].to(torch.float8_e4m3fn).contiguous()
    return q, scale_inv.contiguous()


def quantize(w, *, block: tuple[int, int] = FP8_BLOCK, row_segments: Sequence[int] | None = None):
    """``W [..., N, K]`` (any float dtype) → ``(q float8_e4m3fn [..., N, K], scale_inv float32 [..., S, ⌈K/bk⌉])``."""
    import torch

    segs = _segments(w.shape[-2], row_segments)
    qs, ss, row = [], [], 0
    for n in segs:
        q, s = _quantize_one(w[..., row:row + n, :], block)
        qs.append(q)
        ss.append(s)
        row += n
    if len(segs) == 1:
        return qs[0], ss[0]
    return torch.cat(qs, dim=-2).contiguous(), torch.cat(ss, dim=-2).contiguous()


def expand_scales(scale_inv, rows: int, cols: int, *, block: tuple[int, int] = FP8_BLOCK,
                  row_segments: Sequence[int] | None = None):
    """Per-element float32 scale ``[..., rows, cols]`` from block scales (segment-aware)."""
    import torch

    bn, bk = block
    parts, srow = [], 0
    for n in _segments(rows, row_segments):
        sr = ceil_div(n, bn)
        s = scale_inv[..., srow:srow + sr, :]
        parts.append(s.repeat_interleave(bn, dim=-2)[..., :n, :])
        srow += sr
    if srow != scale_inv.shape[-2] or ceil_div(cols, bk) != scale_inv.shape[-1]:
        raise ValueError(f"scale grid {tuple(scale_inv.shape[-2:])} does not fit a [{rows}, {cols}] weight in "
                         f"{bn}×{bk} blocks (segments {_segments(rows, row_segments)})")
    full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    return full.repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize(q, scale_inv, dtype, *, block: tuple[int, int] = FP8_BLOCK, row_segments: Sequence[int] | None = None):
    """``float(q) · scale_inv`` (float32) rounded once to ``dtype``; ``q [..., N, K]``.

    One float32 temporary of ``q``'s size (multiplied in place, block row by block row; the scales are
    broadcast over a view, never expanded): dequantizing a big dense weight at load costs no more than the
    float32 copy. Each element is one float32 product, so any formulation gives the same bits.
    """
    import torch

    bn, bk = block
    n, k = q.shape[-2:]
    segs = _segments(n, row_segments)
    if sum(ceil_div(x, bn) for x in segs) != scale_inv.shape[-2] or ceil_div(k, bk) != scale_inv.shape[-1]:
        raise ValueError(f"scale grid {tuple(scale_inv.shape[-2:])} does not fit a [{n}, {k}] weight in "
                         f"{bn}×{bk} blocks (segments {segs})")
    out = q.to(torch.float32)
    s32 = scale_inv.to(device=out.device, dtype=torch.float32)
    full = (k // bk) * bk
    row = srow = 0
    for seg in segs:
        for r0 in range(0, seg, bn):
            rows = out[..., row + r0:row + min(seg, r0 + bn), :]
            srow_s = s32[..., srow, :]                             # [..., ⌈K/bk⌉]
            if full:
                rows[..., :full].unflatten(-1, (full // bk, bk)).mul_(srow_s[..., None, : full // bk, None])
            if full < k:
                rows[..., full:].mul_(srow_s[..., None, full // bk:])
            srow += 1
        row += seg
    return out if dtype == torch.float32 else out.to(dtype)
