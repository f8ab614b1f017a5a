"""The dense FP8 block-scaled linear on an sm_90 GPU (``pytest -m gpu``; skipped with the reason where the CuTe
kernels cannot run): ``kernels.fp8_linear.fp8_block_linear`` over the CuTe grouped GEMM with one group.

  * equals the float32 product of the same quantized operands (activations per token and 128-column group, the
    weight's 128×128 blocks) within bf16 output rounding, for token counts on and off the 128-row tile, bias or
    not, at real projection shapes;
  * batch invariant: a token's output row is the same bits alone, in a batch of 300 and in one of 1000;
  * ``checkpoint.fp8_dense``: an ``nn.Linear`` kept FP8 takes this path on bf16 input and stays within one e4m3
    activation rounding of the linear on its dequantized weight.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: bf16 output rounding (2^-8 relative) plus fp32 summation-order differences
BF16_REL = 2 ** -7
#: one e4m3 rounding of the activations (3 mantissa bits)
E4M3_REL = 2 ** -4
#: (out, in): a Qwen3-30B-A3B q_proj and o_proj, a DeepSeek-V3 shared-expert down_proj
SHAPES = [(4096, 2048), (2048, 4096), (7168, 2048)]


@pytest.fixture(scope="module")
def fp8_linear(fp8_cute):  # conftest: skipped where the CuTe kernels cannot run
    from dwdp_runtime.kernels import fp8_linear

    return fp8_linear


def _operands(n, k, seed):
    from dwdp_runtime.quant import fp8_block

    g = torch.Generator().manual_seed(seed)
    wq, ws = fp8_block.quantize(torch.randn(n, k, generator=g) * 0.05)
    return wq.cuda(), ws.cuda(), torch.randn(n, generator=g).cuda()


def _quantized_product(x, wq, ws):
    """The float32 product of the operands the path multiplies: the activations as the path's own quantizer
    (``fp8_quant.quantize_groups``, tested against its reference elsewhere) rounds them — so what is compared is
    the GEMM (a one-ulp e4m3 difference of the torch reference quantizer moved one element by 2^-4 and the
    output by up to 1 %, H100 2026-12-06) — and the dequantized weight."""
    from dwdp_runtime.kernels.fp8_quant import quantize_groups
    from dwdp_runtime.quant import fp8_block

    xq, xs = quantize_groups(x)
    xd = xq.float() * xs.repeat_interleave(128, dim=1)[:, :x.shape[1]]
    return xd @ fp8_block.dequantize(wq, ws, torch.float32).t()


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("tokens", [1, 100, 128, 1000, 4096])
def test_block_linear_equals_the_quantized_product(fp8_linear, n, k, tokens):
    wq, ws, bias = _operands(n, k, seed=n + k)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    assert fp8_linear.unusable(x, wq) is None
    for b in (None, bias):
        y = fp8_linear.fp8_block_linear(x, wq, ws, b)
        want = _quantized_product(x, wq, ws) + (0 if b is None else b)
        assert y.dtype == torch.bfloat16 and y.shape == (tokens, n)
        err = float((y.float() - want).abs().max() / want.abs().max())
        assert err <= BF16_REL, (n, k, tokens, err)


def test_block_linear_is_batch_invariant(fp8_linear):
    wq, ws, _ = _operands(2048, 4096, seed=1)
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    full = fp8_linear.fp8_block_linear(x, wq, ws)
    for rows in (slice(0, 1), slice(0, 300), slice(517, 518)):
        assert torch.equal(fp8_linear.fp8_block_linear(x[rows], wq, ws), full[rows]), rows


def test_a_kept_linear_runs_the_kernel_within_one_activation_rounding(fp8_linear):
    from dwdp_worker.checkpoint import fp8_dense

    wq, ws, bias = _operands(4096, 2048, seed=2)
    lin = torch.nn.Linear(2048, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.bias.copy_(bias)
    fp8_dense.keep_fp8(lin, wq, ws, torch.bfloat16)
    x = torch.randn(3, 50, 2048, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    ref = torch.nn.functional.linear(x, fp8_dense.dequantized_weight(lin), lin.bias)
    assert lin.weight.dtype == torch.float8_e4m3fn and y.shape == ref.shape
    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert 0 < err <= E4M3_REL, err
