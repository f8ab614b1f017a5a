"""The dense FP8 block-scaled linear's plumbing (``kernels.fp8_linear``) on CPU, over the torch block math.

``fp8_block_linear`` pads the tokens to 128-row blocks, lays the activation scales out as the GEMM reads them
(``[K/128, rows]``), maps every block to the one weight and adds the bias. Run with the GEMM's contract in torch
(``block_math_gemm``) and the quantization's reference, its output must equal (up to float32 summation order) a token-by-token block product of
the same quantized operands (``fp8_reference._block_gemm``) — every row, any leading shape, any token count —
and stay within the activation rounding of the linear on the dequantized weight. ``unusable`` names why the CuTe
path cannot run. The same function on the GPU kernel: ``tests/gpu/test_fp8_linear_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dwdp_runtime.kernels import fp8_linear
from dwdp_runtime.kernels.fp8_quant import quantize_groups_reference
from dwdp_runtime.quant import fp8_block

from .fp8_reference import _block_gemm
from .test_fp8_plan_rows import block_math_gemm

#: e4m3 keeps 3 mantissa bits: one activation rounding moves a product by up to 2^-4 relative
E4M3_REL = 2 ** -4
#: float32 sums of 128 products in another order
FP32_REL = 1e-5


def _weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3.0, k)  # columns of different magnitude: real scales
    return fp8_block.quantize(w)


@pytest.mark.parametrize("lead, n, k", [((1,), 128, 128), ((3,), 256, 384), ((2, 70), 128, 256), ((129,), 384, 128),
                                        ((128,), 256, 128),
                                        ((0,), 128, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_linear_equals_the_block_product_row_by_row(lead, n, k, with_bias):
    wq, ws = _weight(n, k, seed=n + k)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*lead, k, generator=g) * 4
    bias = torch.randn(n, generator=g) if with_bias else None
    y = fp8_linear.fp8_block_linear(x, wq, ws, bias, gemm=block_math_gemm, quantize=quantize_groups_reference)
    assert y.shape == (*lead, n) and y.dtype == x.dtype
    rows = x.reshape(-1, k)
    for t in range(rows.shape[0]):
        xq, xs = quantize_groups_reference(rows[t:t + 1])
        want = _block_gemm(xq, xs, wq, ws, torch.arange(n) // 128)[0]
        if bias is not None:
            want = want + bias
        # the same products in the same K-block order; only BLAS's summation inside a block differs by row count
        torch.testing.assert_close(y.reshape(-1, n)[t], want, rtol=FP32_REL, atol=FP32_REL * float(want.abs().max()))
    if rows.shape[0]:
        dense = F.linear(x, fp8_block.dequantize(wq, ws, torch.float32), bias)
        err = (y - dense).abs().max() / dense.abs().max()
        assert 0 < err <= E4M3_REL, float(err)  # the activations really were rounded to e4m3, and only that


def test_unusable_names_the_reason():
    wq, _ = _weight(128, 256, seed=0)
    odd, _ = fp8_block.quantize(torch.randn(576, 128))  # DeepSeek-V3's kv_a_proj_with_mqa: 576 rows
    bf16 = torch.zeros(2, 256, dtype=torch.bfloat16)
    assert "(576, 128) is not a multiple of 128" in fp8_linear.unusable(torch.zeros(2, 128, dtype=torch.bfloat16), odd)
    assert "torch.float32; the FP8 GEMM writes bf16 or fp16" in fp8_linear.unusable(torch.zeros(2, 256), wq)
    assert fp8_linear.unusable(bf16, wq) == "the input is on cpu, not a GPU"


def test_output_keeps_the_input_dtype_whatever_the_bias_dtype():
    """A float32 bias beside bf16 activations (a checkpoint's bias kept at its saved precision) must not promote
    the output: the GPU run of 2026-12-06 returned float32 there (tests/gpu/test_fp8_linear_gpu.py)."""
    wq, ws = _weight(256, 128, seed=3)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    bias = torch.randn(256, generator=g)
    y = fp8_linear.fp8_block_linear(x, wq, ws, bias, gemm=block_math_gemm, quantize=quantize_groups_reference)
    plain = fp8_linear.fp8_block_linear(x, wq, ws, None, gemm=block_math_gemm, quantize=quantize_groups_reference)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (plain.float() + bias).to(torch.bfloat16))
