"""FP4 weight-only MoE kernels under Triton's interpreter: bitwise the bf16 kernels on the dequantized weights.

The FP4 kernels decode each weight tile in the load (E2M1 and the scales from their bits, ``fp4_grouped_gemm``)
and then run the bf16 kernels' MMA sequence and epilogues; so ``fp4_experts`` on packed weights must equal
``fused_experts`` on ``quant.fp4``'s dequantization (in the activations' dtype) **bitwise**, for every layout
(``[gate; up]`` halves, gpt-oss's interleaved rows, no gate, biases), ragged K (a partial 64-wide step),
strided composites, and every scale byte the formats define (E8M0 exponents, e4m3 normals and subnormals).
"""

from __future__ import annotations

import pytest
import torch

from dwdp_runtime.quant import fp4

fp4_moe = pytest.importorskip("dwdp_runtime.kernels.fp4_moe")
moe = pytest.importorskip("dwdp_runtime.kernels.moe")


def _packed(e, n, k, fmt, g, halves=False):
    codes = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    q = fp4.pack(codes)
    if fmt == "mxfp4":
        # E8M0 exponents around 1/√k; the weight of a code is exactly representable in bf16
        s = torch.randint(117, 124, (e, n, k // 32), generator=g, dtype=torch.uint8)
        return q, s, None, None
    # every finite positive e4m3 byte, subnormals (0x01..0x07) included
    s = torch.randint(1, 0x7F, (e, n, k // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    segs = (n // 2, n // 2) if halves else (n,)   # [gate; up] keep a global scale each
    s2 = (torch.rand(e, len(segs), generator=g) * 2e-4 + 1e-5).to(torch.float32)   # weights of O(0.1)
    return q, s, s2, segs


def _weights(fmt, e, h, i, g, *, has_gate=True, bias=False, gpt_oss_blocks=False):
    n1 = 2 * i if has_gate else i
    q1, s1, s21, segs1 = _packed(e, n1, h, fmt, g, halves=has_gate)
    q2, s2, s22, segs2 = _packed(e, h, i, fmt, g)
    b1 = (0.1 * torch.randn(e, n1, generator=g)).to(torch.bfloat16) if bias else None   # the compute dtype's
    b2 = (0.1 * torch.randn(e, h, generator=g)).to(torch.bfloat16) if bias else None
    if gpt_oss_blocks:
        q1, q2 = q1.reshape(e, n1, h // 32, 16), q2.reshape(e, h, i // 32, 16)
    return fp4_moe.Fp4Weights(fmt, q1, s1, q2, s2, s21, s22, b1, b2), (segs1, segs2)


def _dequantized(w: "fp4_moe.Fp4Weights", segs, dtype):
    if w.format == "mxfp4":
        d1 = fp4.mxfp4_dequantize(w.gate_up, w.gate_up_scale, dtype)
        d2 = fp4.mxfp4_dequantize(w.down, w.down_scale, dtype)
    else:
        d1 = fp4.nvfp4_dequantize(w.gate_up, w.gate_up_scale, w.gate_up_scale_2, dtype, row_segments=segs[0])
        d2 = fp4.nvfp4_dequantize(w.down, w.down_scale, w.down_scale_2, dtype, row_segments=segs[1])
    return moe.ExpertWeights(d1, d2, w.gate_up_bias, w.down_bias)


def _routing(t, e, k, g):
    w, ids = torch.topk(torch.rand(t, e, generator=g).softmax(-1), k, dim=-1)
    return ids, w


LAYOUTS = {
    "concatenated": dict(),
    "interleaved": dict(is_concatenated=False),
    "no_gate": dict(has_gate=False),
    "bias": dict(has_bias=True),
}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fp4_experts_equal_bf16_kernels_on_dequantized_weights(fmt, name):
    g = torch.Generator().manual_seed(len(name) + (fmt == "nvfp4"))
    opts = LAYOUTS[name]
    layout = moe.ExpertsLayout(**opts)
    e, h, i, t, k = 5, 96, 64, 27, 2       # H = 96: one full and one half 64-wide K step in GEMM 1
    w, segs = _weights(fmt, e, h, i, g, has_gate=layout.has_gate, bias=layout.has_bias,
                       gpt_oss_blocks=fmt == "mxfp4" and name == "interleaved")
    if fmt == "nvfp4" and not layout.is_concatenated:  # interleaved rows share one global scale
        w = fp4_moe.Fp4Weights(fmt, w.gate_up, w.gate_up_scale, w.down, w.down_scale, w.gate_up_scale_2[:, :1],
                               w.down_scale_2)
        segs = (None, segs[1])
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, rw = _routing(t, e, k, g)
    got = fp4_moe.fp4_experts(x, ids, rw, w, layout)
    want = moe.fused_experts(x, ids, rw, _dequantized(w, segs, torch.bfloat16), layout)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
    assert got.abs().sum() > 0


def test_fp4_experts_read_strided_composites_and_drop_unknown_experts():
    """Weights as views into bigger tensors (the composite's experts inside a page-padded buffer) and expert
    ids outside [0, E) (rows that count as zero), as the bf16 kernels."""
    g = torch.Generator().manual_seed(7)
    e, h, i, t, k = 4, 64, 32, 19, 3
    w, segs = _weights("nvfp4", e, h, i, g)
    big = torch.zeros(e, 2 * i + 8, h // 2 + 16, dtype=torch.uint8)
    big[:, 3:3 + 2 * i, 5:5 + h // 2] = w.gate_up
    strided = fp4_moe.Fp4Weights("nvfp4", big[:, 3:3 + 2 * i, 5:5 + h // 2], w.gate_up_scale, w.down, w.down_scale,
                                 w.gate_up_scale_2, w.down_scale_2)
    assert not strided.gate_up.is_contiguous()
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, rw = _routing(t, e, k, g)
    ids[2, 1] = e + 3
    got = fp4_moe.fp4_experts(x, ids, rw, strided)
    want = moe.fused_experts(x, ids, rw, _dequantized(w, segs, torch.bfloat16))
    assert torch.equal(got, want)


def test_fp4_experts_are_batch_invariant():
    g = torch.Generator().manual_seed(3)
    e, h, i = 6, 64, 64
    w, _ = _weights("mxfp4", e, h, i, g)
    x = torch.randn(40, h, generator=g).to(torch.bfloat16)
    ids, rw = _routing(40, e, 2, g)
    whole = fp4_moe.fp4_experts(x, ids, rw, w)
    part = fp4_moe.fp4_experts(x[5:9], ids[5:9], rw[5:9], w)
    assert torch.equal(whole[5:9], part)


def test_shape_mismatch_is_refused():
    g = torch.Generator().manual_seed(4)
    w, _ = _weights("mxfp4", 3, 64, 32, g)
    with pytest.raises(ValueError, match="disagree"):
        fp4_moe.fp4_experts(torch.zeros(4, 96, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.long),
                            torch.ones(4, 1), w)


def test_model_fp4_forward_reads_the_bound_composites():
    """``model.fp4_experts_gpu.forward`` on a real `transformers` experts module holding NVFP4 composites (the
    names and layout flags the loader declares) == the bf16 kernels on the dequantized weights."""
    import transformers

    from dwdp_runtime.quant import QuantFormat
    from dwdp_worker.checkpoint.fp4_layout import Fp4Experts, Fp4Projection
    from dwdp_worker.model import fp4_experts_gpu

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    g = torch.Generator().manual_seed(9)
    w, segs = _weights("nvfp4", 4, 64, 32, g)
    for name, value in (("gate_up_proj", w.gate_up), ("gate_up_proj_weight_scale", w.gate_up_scale),
                        ("gate_up_proj_weight_scale_2", w.gate_up_scale_2), ("down_proj", w.down),
                        ("down_proj_weight_scale", w.down_scale), ("down_proj_weight_scale_2", w.down_scale_2)):
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    spec = Fp4Experts(QuantFormat.NVFP4, (
        Fp4Projection("gate_up_proj", ("gate_up_proj_weight_scale", "gate_up_proj_weight_scale_2"), (32, 32), False),
        Fp4Projection("down_proj", ("down_proj_weight_scale", "down_proj_weight_scale_2"), (64,), False)),
        torch.bfloat16)
    setattr(module, fp4_experts_gpu.FP4_STATE_ATTR, spec)
    x = torch.randn(13, 64, generator=g).to(torch.bfloat16)
    ids, rw = _routing(13, 4, 2, g)
    assert fp4_experts_gpu.unsupported_reason(module, x).startswith("FP4 Triton kernels unavailable on cpu")
    got = fp4_experts_gpu.forward(module, x, ids, rw)
    assert torch.equal(got, moe.fused_experts(x, ids, rw, _dequantized(w, segs, torch.bfloat16)))


def test_deepseek_v4_containers_run_the_mxfp4_math():
    """DeepSeek-V4's experts (int8 codes, float8_e8m0fnu scales: ``fp4-ue8m0``) are MXFP4's bytes in other dtypes."""
    g = torch.Generator().manual_seed(11)
    w, segs = _weights("mxfp4", 4, 64, 32, g)
    v4 = fp4_moe.Fp4Weights("fp4-ue8m0", w.gate_up.view(torch.int8), w.gate_up_scale.view(torch.float8_e8m0fnu),
                            w.down.view(torch.int8), w.down_scale.view(torch.float8_e8m0fnu))
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    ids, rw = _routing(9, 4, 2, g)
    assert torch.equal(fp4_moe.fp4_experts(x, ids, rw, v4), moe.fused_experts(x, ids, rw, _dequantized(w, segs,
                                                                                                        torch.bfloat16)))


def _bf16_bits(bits):
    """16-bit patterns (int64 tensor) → their bf16 values, as float64."""
    return ((bits & 0xFFFF) << 16).to(torch.int32).view(torch.float32).double()


def test_fast_decode_recipe_is_exact_for_every_byte_and_scale():
    """The compiled kernels' bit recipe (``fp4_grouped_gemm._MX_ASM`` / ``_NV_ASM``; PTX, so not run by the
    interpreter) emulated here: the placed halves are e2m1 · 2^-126, every partial product is a bf16 value, and the
    result equals ``quant.fp4``'s dequantization for all 256 bytes × every E8M0 byte, and × every finite e4m3
    byte for NVFP4."""
    ggemm = pytest.importorskip("dwdp_runtime.kernels.fp4_grouped_gemm")
    assert "0x40040" in ggemm._MX_ASM.value and "0x01C001C0" in ggemm._MX_ASM.value
    b = torch.arange(256, dtype=torch.int64)
    words = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & 0x80008000)
    halves = (_bf16_bits(words), _bf16_bits(words >> 16))
    vals = fp4.unpack(b.to(torch.uint8)[:, None]).double()
    exact = lambda v: torch.equal(v.float().to(torch.bfloat16).double(), v)  # noqa: E731
    for t, x in enumerate(halves):
        assert torch.equal(x * 2.0 ** 126, vals[:, t])
    for s in range(255):
        f1, f2 = _bf16_bits(torch.tensor((min(s, 128) + 126) << 7)), _bf16_bits(torch.tensor((max(s, 128) - 1) << 7))
        want = fp4.mxfp4_dequantize(torch.full((256, 16), 0, dtype=torch.uint8) + b.to(torch.uint8)[:, None],
                                    torch.full((256, 1), s, dtype=torch.uint8), torch.bfloat16).double()[:, :2]
        for t, x in enumerate(halves):
            assert exact(x * f1) and torch.equal((x * f1 * f2).float().to(torch.bfloat16).double(), want[:, t]), s
    for sb in range(0x01, 0x7F):
        sv = torch.tensor([sb], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        for t, x in enumerate(halves):
            q = x * 2.0 ** 126 * sv
            assert exact(q), sb
            for s2 in (1e-5, 3.7e-3, 0.123):
                got = (q.float() * torch.tensor(s2)).to(torch.bfloat16)
                assert torch.equal(got, (vals[:, t].float() * sv.float() * torch.tensor(s2)).to(torch.bfloat16))


def test_fp4_configs_keep_the_bf16_tiles_under_the_interpreter():
    from dwdp_runtime.kernels.tuning import GemmConfig

    c1, c2 = GemmConfig(block_m=128, block_n=128, num_warps=8), GemmConfig(block_m=128, block_n=256, num_warps=8)
    assert fp4_moe.fp4_configs(c1, c2, 4096) == (c1, c2)
