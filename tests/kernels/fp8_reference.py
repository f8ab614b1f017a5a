"""Torch references for the FP8 block-scaled MoE kernels (tests and bench).

``fp8_moe_reference`` computes, pair by pair in float32, the exact block-scaled math the kernels implement:
activations quantized per token and 128-column group (``fp8_quant.quantize_groups_reference``), each GEMM as
``Σ_kb (q_a · q_w over the 128-block) · s_a · s_w`` in ascending kb, GEMM 1's output quantized per row and
128-column group before GEMM 2, routing weight, each pair's row rounded to the output dtype, fixed-order
fp32 top-k sum. ``dequantized_moe_reference`` is the
model's semantics on the dequantized weights in float32 (no activation quantization): the kernels differ from
it only by the activation rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dwdp_runtime.kernels.fp8_quant import quantize_groups_reference
from dwdp_runtime.quant import fp8_block

B = 128


def _block_gemm(aq, a_s, wq, ws, col_srow):
    """``[R, K] e4m3 × [N, K] e4m3`` with row scales ``a_s [R, ⌈K/128⌉]`` and column scale rows ``col_srow [N]``."""
    k = aq.shape[1]
    out = torch.zeros(aq.shape[0], wq.shape[0], dtype=torch.float32)
    for kb in range(-(-k // B)):
        sl = slice(kb * B, min(k, (kb + 1) * B))
        part = aq[:, sl].float() @ wq[:, sl].float().T
        out += part * (a_s[:, kb:kb + 1] * ws[col_srow, kb][None, :])
    return out


def fp8_moe_reference(x, ids, weights, w1, s1, w2, s2, act=F.silu, out_dtype=torch.bfloat16, plan_rows=False,
                      fused_act=False):
    """The Triton path's numerics; ``plan_rows``: the CuTe path's (``fp8_cute``) — GEMM 2's output rounded to
    bf16 before the routing weight, the weighted sum in fp32 from those rows, and GEMM 1's output rounded to
    bf16 before the activation unless ``fused_act`` (the fused gate_up keeps it in fp32, as Triton does)."""
    t, top_k = ids.shape
    e, n1, h = w1.shape
    inter = w2.shape[2]
    up_srow = -(-inter // B)
    xq, xs = quantize_groups_reference(x)
    cols = torch.arange(inter)
    y = torch.zeros(t, top_k, h, dtype=torch.float32)
    for tok in range(t):
        for j in range(top_k):
            ex = int(ids[tok, j])
            if not 0 <= ex < e:
                continue
            g = _block_gemm(xq[tok:tok + 1], xs[tok:tok + 1], w1[ex, :inter], s1[ex], cols // B)
            u = _block_gemm(xq[tok:tok + 1], xs[tok:tok + 1], w1[ex, inter:], s1[ex], up_srow + cols // B)
            if plan_rows and not fused_act:
                g, u = g.to(torch.bfloat16).float(), u.to(torch.bfloat16).float()
            a = act(g) * u
            aq, a_s = quantize_groups_reference(a)
            d = _block_gemm(aq, a_s, w2[ex], s2[ex], torch.arange(h) // B)
            if plan_rows:
                y[tok, j] = d[0].to(torch.bfloat16).float() * weights[tok, j].float()
            else:
                y[tok, j] = (d[0] * weights[tok, j].float()).to(out_dtype).float()  # GEMM 2 stores y in out_dtype
    out = y[:, 0].clone()
    for j in range(1, top_k):
        out += y[:, j]
    return out.to(out_dtype)


def dequantized_moe_reference(x, ids, weights, w1, s1, w2, s2, act=F.silu):
    inter = w2.shape[2]
    d1 = fp8_block.dequantize(w1, s1, torch.float32, row_segments=(inter, inter))
    d2 = fp8_block.dequantize(w2, s2, torch.float32)
    xf = x.float()
    out = torch.zeros(x.shape[0], w1.shape[2], dtype=torch.float32)
    for tok in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[tok, j])
            gu = d1[ex] @ xf[tok]
            out[tok] += weights[tok, j].float() * (d2[ex] @ (act(gu[:inter]) * gu[inter:]))
    return out


def small_fp8_block_case(seed: int = 1):
    """``(x, ids, weights, w1, s1, w2, s2)`` on CPU: 37 tokens, 6 experts, H 512, I 384, top-2 — the GPU tests'
    small block (``tests/gpu``), seeded."""
    g = torch.Generator().manual_seed(seed)
    e, h, i, t, k = 6, 512, 384, 37, 2
    w1, s1 = fp8_block.quantize(torch.randn(e, 2 * i, h, generator=g) * h ** -0.5, row_segments=(i, i))
    w2, s2 = fp8_block.quantize(torch.randn(e, h, i, generator=g) * i ** -0.5)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    return x, ids, w, w1, s1, w2, s2
