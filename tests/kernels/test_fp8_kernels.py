"""FP8 block-scaled MoE kernels under Triton's interpreter: the exact block math, routing edge cases, strides.

The interpreter mishandles fp8 (ties away from zero, no subnormals, no saturation on fp32 → e4m3; a wrong
``tl.dot`` on e4m3 operands): the kernels round on the fp32 bits and widen e4m3 operands to fp32 there
(``fp8_quant``/``fp8_grouped_gemm`` docstrings), so these tests check the kernels' indexing, scaling and
fusion; the GPU's own fp8 conversion and MMA are checked on H200 (``tests/gpu``, ``bench/moe_kernels.py``).
"""

from __future__ import annotations

import pytest
import torch

from dwdp_runtime.quant import fp8_block

from .fp8_reference import dequantized_moe_reference, fp8_moe_reference

fp8_moe = pytest.importorskip("dwdp_runtime.kernels.fp8_moe")
fp8_quant = pytest.importorskip("dwdp_runtime.kernels.fp8_quant")


def _experts(e, h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, s1 = fp8_block.quantize(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, row_segments=(i, i))
    w2, s2 = fp8_block.quantize(torch.randn(e, h, i, generator=g) / i ** 0.5)
    return w1, s1, w2, s2


def test_activation_quantization_is_round_to_nearest_even():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(21, 300, generator=g) * torch.logspace(-5, 3, 300)).to(torch.bfloat16)
    x[3] = 0                      # an all-zero row: scale 1, zeros
    x[4, :128] = -1e-30           # values that round to (negative) zero
    q, s = fp8_quant.quantize_groups(x)
    qr, sr = fp8_quant.quantize_groups_reference(x)
    assert s.shape == (21, 3) and torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def _ids(case, t, k, e, g):
    ids = torch.randint(0, e, (t, k), generator=g)
    if case == "one_expert_takes_all":
        ids[:, 0] = 2
        ids[:, 1] = 3
    elif case == "empty_experts":
        ids = ids % 2                 # experts 2.. get nothing
        ids[:, 1] = 1 - ids[:, 0]
    return ids


@pytest.mark.parametrize("case, t, h, i", [("random", 13, 256, 192), ("one_expert_takes_all", 9, 256, 128),
                                           ("empty_experts", 7, 200, 64), ("random", 1, 128, 256)])
def test_fp8_moe_matches_block_math(case, t, h, i):
    e, k = 5, 2
    g = torch.Generator().manual_seed(len(case) * 31 + t)
    w1, s1, w2, s2 = _experts(e, h, i)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = _ids(case, t, k, e, g)
    w = torch.rand(t, k, generator=g)
    out = fp8_moe.fp8_moe_forward(x, ids, w, w1, s1, w2, s2)
    want = fp8_moe_reference(x, ids, w, w1, s1, w2, s2)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    # same operands and scales; only fp32 summation order differs (1 bf16 ulp, or one activation tie flipped)
    err = (out.float() - want.float()).abs()
    assert float(err.max()) <= 2 ** -6 * float(want.abs().max()), float(err.max())
    assert float(err.mean()) <= 2 ** -10 * float(want.abs().max())
    # and the model's semantics on the dequantized weights, up to e4m3 activation rounding (~2^-4 relative)
    deq = dequantized_moe_reference(x, ids, w, w1, s1, w2, s2)
    assert float((out.float() - deq).abs().max()) <= 0.1 * float(deq.abs().max())


def test_fp8_moe_reads_strided_composites_without_copy():
    """Weights and scales as views with a padded expert stride (as a composite tensor may be): same result."""
    e, h, i, t, k = 4, 256, 128, 6, 2
    w1, s1, w2, s2 = _experts(e, h, i, seed=3)

    def padded(tensor):
        big = torch.zeros(tensor.shape[0], tensor.shape[1] + 3, tensor.shape[2], dtype=tensor.dtype)
        big[:, :tensor.shape[1]] = tensor
        view = big[:, :tensor.shape[1]]
        assert not view.is_contiguous()
        return view

    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    want = fp8_moe.fp8_moe_forward(x, ids, w, w1, s1, w2, s2)
    got = fp8_moe.fp8_moe_forward(x, ids, w, padded(w1), padded(s1), padded(w2), padded(s2))
    assert torch.equal(got, want)


def test_fp8_moe_refuses_wrong_grids():
    w1, s1, w2, s2 = _experts(3, 256, 128)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="scale grids"):
        fp8_moe.fp8_moe_forward(x, ids, torch.ones(2, 1), w1, s1[:, :1], w2, s2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_moe.fp8_moe_forward(x, ids, torch.ones(2, 1), w1.float(), s1, w2, s2)


@pytest.mark.parametrize("h, i", [(384, 256), (256, 192)])
def test_fp8_tilings_are_bitwise_equal(h, i):
    """Every tiling the tuner may pick gives the same bits: GEMM 1 in one pass or two 64-column passes per
    activation group, GEMM 2 with one weight scale per tile (BLOCK_N 64 or 128) or one per column (256), weight tiles
    through TMA descriptors or pointers, 16- to 64-row blocks (batch invariance: the K order and the promotion
    per 128-deep block never change)."""
    from dwdp_runtime.kernels.tuning import GemmConfig

    e, k, t = 5, 2, 11
    w1, s1, w2, s2 = _experts(e, h, i, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    xq, xs = fp8_quant.quantize_groups(x)

    def run(bm, n2, tma, n1=128):
        c1 = GemmConfig(block_m=bm, block_n=n1, block_k=128, tma=tma)
        c2 = GemmConfig(block_m=bm, block_n=n2, block_k=128, tma=tma)
        return fp8_moe._run(xq, xs, ids, w, w1, s1, w2, s2, c1, c2, has_gate=True, activation="silu",
                            out_dtype=torch.bfloat16)

    want = run(16, 128, False)
    for bm, n2, tma, n1 in [(16, 256, False, 128), (64, 128, True, 128), (64, 256, True, 64), (32, 128, False, 64),
                            (64, 64, True, 64), (16, 64, False, 128)]:
        assert torch.equal(run(bm, n2, tma, n1), want), (bm, n2, tma, n1)
