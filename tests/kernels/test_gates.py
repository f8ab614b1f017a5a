"""Clamped gated activations (``kernels.gates``): found from the module's own ``_apply_gate``, fused into GEMM 1.

* ``match`` on real `transformers` experts modules: gpt-oss's clamped SwiGLU (α, +1, interleaved) and
  DeepSeek-V4's (silu, [gate; up] halves) are recognised with the module's own limit/alpha; the default gate,
  other custom gates and gates that fail on the probe are not.
* The kernels under Triton's interpreter: the FP4 weight-only experts with the clamped epilogue equal the bf16
  kernels on the dequantized weights **bitwise**, and both agree with `transformers`' own gpt-oss / DeepSeek-V4
  experts forward (float32, the oracle) within bf16 rounding — biases, interleaved rows, values past the clamp.
* ``model.fp4_experts_gpu`` serves a gpt-oss experts module holding MXFP4 composites through the kernels.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from dwdp_runtime.kernels import gates
from dwdp_runtime.quant import fp4

fp4_moe = pytest.importorskip("dwdp_runtime.kernels.fp4_moe")
moe = pytest.importorskip("dwdp_runtime.kernels.moe")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


def _gpt_oss_config():
    return transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _gpt_oss_experts(limit=None):
    module = gpt_oss.GptOssExperts(_gpt_oss_config())
    if limit is not None:
        module.limit = limit
    return module


def _deepseek_v4_experts():
    d4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = transformers.DeepseekV4Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=1)
    return d4.DeepseekV4Experts(cfg)


def test_match_finds_gpt_oss_and_deepseek_v4_clamped_gates_with_their_own_constants():
    module = _gpt_oss_experts()
    assert gates.match(module, concatenated=False) == gates.ClampedGlu(module.limit, module.alpha, 1.0)
    assert gates.match(_gpt_oss_experts(limit=3.25), concatenated=False).limit == 3.25
    assert gates.match(module, concatenated=True) is None   # the wrong row layout does not compute the same
    v4 = _deepseek_v4_experts()
    assert gates.match(v4, concatenated=True) == gates.ClampedGlu(v4.limit, 1.0, 0.0)


def test_other_gates_are_not_matched():
    class GeluGate(gpt_oss.GptOssExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return torch.nn.functional.gelu(gate.clamp(max=self.limit)) * (up.clamp(-self.limit, self.limit) + 1)

    class Broken(gpt_oss.GptOssExperts):
        def _apply_gate(self, gate_up):
            raise RuntimeError("needs a GPU")

    for cls in (GeluGate, Broken):
        assert gates.match(cls(_gpt_oss_config()), concatenated=False) is None, cls.__name__
    qcfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert gates.match(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(qcfg), True) is None


def _packed_mxfp4(e, n, k, g):
    codes = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 128, (e, n, k // 32), generator=g, dtype=torch.uint8)  # gate_up values reach ±L
    return fp4.pack(codes), scales


def _routing(t, e, k, g):
    w, ids = torch.topk(torch.rand(t, e, generator=g).softmax(-1), k, dim=-1)
    return ids, w


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v4"])
def test_clamped_fp4_experts_equal_the_bf16_kernels_and_agree_with_transformers(arch):
    g = torch.Generator().manual_seed(5)
    module = _gpt_oss_experts() if arch == "gpt_oss" else _deepseek_v4_experts()
    concatenated = arch != "gpt_oss"
    glu = gates.match(module, concatenated)
    e, h = 4, 64
    inter = module.gate_up_proj.shape[-1] // 2 if arch == "gpt_oss" else module.gate_up_proj.shape[1] // 2
    q1, s1 = _packed_mxfp4(e, 2 * inter, h, g)
    q2, s2 = _packed_mxfp4(e, h, inter, g)
    bias = arch == "gpt_oss"
    b1 = (0.5 * torch.randn(e, 2 * inter, generator=g)).to(torch.bfloat16) if bias else None
    b2 = (0.5 * torch.randn(e, h, generator=g)).to(torch.bfloat16) if bias else None
    w = fp4_moe.Fp4Weights("mxfp4", q1, s1, q2, s2, None, None, b1, b2)
    layout = moe.ExpertsLayout(is_concatenated=concatenated, has_bias=bias, glu=glu)
    t, k = 21, 2
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, rw = _routing(t, e, k, g)
    got = fp4_moe.fp4_experts(x, ids, rw, w, layout)
    d1, d2 = fp4.mxfp4_dequantize(q1, s1, torch.bfloat16), fp4.mxfp4_dequantize(q2, s2, torch.bfloat16)
    bf16 = moe.fused_experts(x, ids, rw, moe.ExpertWeights(d1, d2, b1, b2), layout)
    assert torch.equal(got, bf16)

    # the oracle: transformers' own experts forward, float32, on the same (dequantized) weights
    params = module._parameters
    if arch == "gpt_oss":   # [E, in, out] storage
        params["gate_up_proj"] = torch.nn.Parameter(d1.float().transpose(1, 2).contiguous(), requires_grad=False)
        params["down_proj"] = torch.nn.Parameter(d2.float().transpose(1, 2).contiguous(), requires_grad=False)
        params["gate_up_proj_bias"] = torch.nn.Parameter(b1.float(), requires_grad=False)
        params["down_proj_bias"] = torch.nn.Parameter(b2.float(), requires_grad=False)
    else:
        params["gate_up_proj"] = torch.nn.Parameter(d1.float(), requires_grad=False)
        params["down_proj"] = torch.nn.Parameter(d2.float(), requires_grad=False)
    with torch.no_grad():
        want = module(x.float(), ids, rw.float())
    gate_up = torch.einsum("th,enh->ten", x.float(), d1.float())
    clamped = (gate_up.abs() > glu.limit).float().mean()
    assert clamped > 0.05, "the probe weights must drive gate/up past the clamp"
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 2e-2, float(err)


def test_the_model_forward_serves_gpt_oss_mxfp4_experts_through_the_kernels():
    """A real GptOssExperts module holding MXFP4 composites: ``fp4_experts_gpu.forward`` takes the clamped
    epilogue (not the dequantizing fallback) and equals the FP4 kernels with the matched ``ClampedGlu``."""
    from dwdp_runtime.quant import QuantFormat
    from dwdp_worker.checkpoint.fp4_layout import Fp4Experts, Fp4Projection
    from dwdp_worker.model import fp4_experts_gpu

    module = _gpt_oss_experts()
    g = torch.Generator().manual_seed(8)
    q1, s1 = _packed_mxfp4(4, 128, 64, g)
    q2, s2 = _packed_mxfp4(4, 64, 64, g)
    b1, b2 = torch.randn(4, 128, generator=g).bfloat16(), torch.randn(4, 64, generator=g).bfloat16()
    for name, value in (("gate_up_proj", q1), ("gate_up_proj_scales", s1), ("down_proj", q2),
                        ("down_proj_scales", s2), ("gate_up_proj_bias", b1), ("down_proj_bias", b2)):
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    spec = Fp4Experts(QuantFormat.MXFP4, (Fp4Projection("gate_up_proj", ("gate_up_proj_scales",), (128,), True),
                                          Fp4Projection("down_proj", ("down_proj_scales",), (64,), True)),
                      torch.bfloat16)
    setattr(module, fp4_experts_gpu.FP4_STATE_ATTR, spec)
    assert fp4_experts_gpu.clamped_glu(module) == gates.ClampedGlu(7.0, 1.702, 1.0)
    x = torch.randn(11, 64, generator=g).to(torch.bfloat16)
    ids, rw = _routing(11, 4, 2, g)
    got = fp4_experts_gpu.forward(module, x, ids, rw)
    layout = moe.ExpertsLayout(is_concatenated=False, has_bias=True, glu=gates.ClampedGlu(7.0, 1.702, 1.0))
    want = fp4_moe.fp4_experts(x, ids, rw, fp4_moe.Fp4Weights("mxfp4", q1, s1, q2, s2, None, None, b1, b2), layout)
    assert torch.equal(got, want)


def test_a_clamped_gate_without_a_gate_projection_is_refused():
    g = torch.Generator().manual_seed(2)
    q, s = _packed_mxfp4(2, 32, 64, g)
    q2, s2 = _packed_mxfp4(2, 64, 32, g)
    layout = moe.ExpertsLayout(has_gate=False, glu=gates.ClampedGlu(7.0))
    with pytest.raises(ValueError, match="clamped gated activation"):
        fp4_moe.fp4_experts(torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long),
                            torch.ones(3, 1), fp4_moe.Fp4Weights("mxfp4", q, s, q2, s2), layout)
