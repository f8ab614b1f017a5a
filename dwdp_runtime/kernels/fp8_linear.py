"""A dense FP8 block-scaled linear on the CuTe DSL GEMM: ``y = x · dequant(w)ᵀ + b`` without dequantizing ``w``.

``fp8_block_linear(x [..., K], w e4m3 [N, K], ws fp32 [⌈N/128⌉, ⌈K/128⌉], bias)`` quantizes ``x`` per token and
128-column group (``fp8_quant``, the experts' dynamic activation scheme) and runs the block-scaled grouped GEMM of
the experts path (``fp8_cute.block_scaled_grouped_gemm``) with one group: ``w`` as expert 0, every 128-row block
of the padded token rows mapped to it. The weight stays 1 byte per element in HBM — the reason to keep the dense
projections FP8 at all (issue #34: a DeepSeek-V3 rank holds ≈ 15 GiB less than with bf16 dense weights, and the
GEMM reads half the bytes).

Numerics: the experts' — each 128-deep K step an e4m3 MMA promoted into fp32 as ``acc += part · (s_a · s_w)``,
the output rounded once to bf16/fp16; a row depends only on itself (no split-K, no atomics), so the result is
batch invariant. It differs from the bf16 linear on the dequantized weight by the activation rounding only.

``unusable(x, w)`` says why a call cannot take this path (None when it can): the CuTe kernels unavailable here
(no sm_90 GPU, no ``nvidia-cutlass-dsl``), N or K not a multiple of 128 (DeepSeek-V3's ``kv_a_proj_with_mqa``
has N = 576), an input that is not bf16/fp16, a weight that is not K-contiguous on 16-byte boundaries (TMA).
The caller then dequantizes (``dwdp_worker.checkpoint.fp8_dense``).

``gemm`` and ``quantize`` are arguments so the CPU tests run this exact plumbing (padding, scale layout, bias)
over the torch block math.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..quant.scheme import FP8_SCALE_BLOCK
from .fp8_cute import TILE_M, TMA_ALIGN

#: the activation dtypes the GEMM's 16-bit epilogue writes
OUTPUT_DTYPES = (torch.bfloat16, torch.float16)


def unusable(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why ``fp8_block_linear(x, w, …)`` cannot run here, or None (the operands' reasons first, then the machine's)."""
    n, k = w.shape
    if n % FP8_SCALE_BLOCK or k % FP8_SCALE_BLOCK:
        return f"weight {tuple(w.shape)} is not a multiple of {FP8_SCALE_BLOCK} in both dimensions"
    if x.dtype not in OUTPUT_DTYPES:
        return f"the input is {x.dtype}; the FP8 GEMM writes bf16 or fp16"
    if x.device.type != "cuda":
        return f"the input is on {x.device.type}, not a GPU"
    if w.stride(1) != 1 or (w.stride(0) * w.element_size()) % TMA_ALIGN or w.data_ptr() % TMA_ALIGN:
        return "the weight is not K-contiguous on 16-byte boundaries (TMA)"
    from . import fp8_cute

    return fp8_cute.unavailable(x.device)


def _cute_gemm(a, sa, w, ws, block_expert, out_dtype):
    from .fp8_cute import block_scaled_grouped_gemm

    return block_scaled_grouped_gemm(a, sa, w, ws, block_expert, out_dtype=out_dtype)


def _triton_quantize(x):
    from .fp8_quant import quantize_groups

    return quantize_groups(x)


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None, *,
                     gemm: Callable = _cute_gemm, quantize: Callable = _triton_quantize) -> torch.Tensor:
    """``x [..., K]`` times the block-scaled ``w [N, K]`` (scales ``ws [N/128, K/128]``), plus ``bias``: ``[..., N]``
    in ``x``'s dtype. ``gemm(a [rows, K], sa [K/128, rows], w [1, N, K], ws [1, N/128, K/128], block_expert,
    out_dtype)`` is the block-scaled grouped GEMM's contract, rows a multiple of 128."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    tokens = x2.shape[0]
    if tokens == 0:
        return x.new_zeros(*lead, w.shape[0])
    rows = -(-tokens // TILE_M) * TILE_M
    xq, xs = quantize(x2)
    a = xq
    if rows != tokens:  # zero rows to the tile (through bytes: fill kernels for float8 are not in every torch)
        padded = torch.zeros(rows, k, dtype=torch.uint8, device=x.device)
        padded[:tokens] = xq.view(torch.uint8)
        a = padded.view(xq.dtype)
    sa = torch.ones(xs.shape[1], rows, dtype=torch.float32, device=x.device)  # [K/128, rows]: the kernel's layout
    sa[:, :tokens] = xs.t()
    block_expert = torch.zeros(rows // TILE_M, dtype=torch.int32, device=x.device)
    y = gemm(a, sa, w.unsqueeze(0), ws.unsqueeze(0), block_expert, x.dtype)[:tokens]
    if bias is not None:  # in x's dtype whatever the bias's (a float32 bias would promote the output)
        y = (y + bias).to(x.dtype)
    return y.reshape(*lead, w.shape[0])
