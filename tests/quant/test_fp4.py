"""FP4 (E2M1) math and declarations: packing, rounding, MXFP4/NVFP4 dequantize against their definitions,
`transformers`' own MXFP4 dequantize, the declared tensors, the config parsing and the per-part memory."""

from __future__ import annotations

import pytest
import torch

from dwdp_runtime import layout
from dwdp_runtime.quant import (MXFP4_SCHEME, NVFP4_SCHEME, QuantFormat, TensorRole, UnsupportedQuantizationError,
                                expert_memory, fp4_config_dict, layer_tensors, modelopt_config_from_hf_quant,
                                parse_quantization_config)
from dwdp_runtime.quant import fp4

#: the E2M1 table, written out here (OCP MX v1.0, table 5) rather than read from the module
TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_pack_is_low_nibble_first_and_unpack_inverts_it():
    codes = torch.tensor([[1, 2, 15, 8, 7, 0]], dtype=torch.uint8)
    packed = fp4.pack(codes)
    assert packed.tolist() == [[0x21, 0x8F, 0x07]]
    assert fp4.unpack(packed).tolist() == [[TABLE[c] for c in codes[0].tolist()]]
    everything = torch.arange(256, dtype=torch.uint8)[None]
    assert fp4.unpack(everything).reshape(-1, 2).tolist() == [[TABLE[b & 15], TABLE[b >> 4]] for b in range(256)]


def test_encode_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 4.99, 5.01, 7.0, -7.0, -0.2, -1.6, 0.0])
    got = [TABLE[c] for c in fp4.encode(x).tolist()]
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 4.0, 6.0, 6.0, -6.0, 0.0, -1.5, 0.0]
    grid = torch.tensor(TABLE)
    assert [TABLE[c] for c in fp4.encode(grid).tolist()] == TABLE[:8] + [0.0] + TABLE[9:]  # exact values stay


def test_mxfp4_dequantize_is_the_definition_and_transformers_agrees():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 8, 64), generator=g, dtype=torch.uint8)
    e = torch.randint(110, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = torch.tensor(TABLE)[codes.long()] * 2.0 ** (e.float() - 127).repeat_interleave(32, -1)
    got = fp4.mxfp4_dequantize(fp4.pack(codes), e, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(fp4.mxfp4_dequantize(fp4.pack(codes).reshape(3, 8, 2, 16), e, torch.float32), want)
    assert torch.equal(fp4.mxfp4_dequantize(fp4.pack(codes), e, torch.bfloat16), want.to(torch.bfloat16))
    # transformers' gpt-oss loader: blocks [E, out, in/32, 16] -> its parameter [E, in, out]
    ref = convert_moe_packed_tensors(fp4.pack(codes).reshape(3, 8, 2, 16), e, dtype=torch.float32)
    assert torch.equal(ref, want.transpose(1, 2))


def test_nvfp4_dequantize_is_the_definition_per_projection():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, 12, 32), generator=g, dtype=torch.uint8)
    s = (torch.rand(2, 12, 2, generator=g) * 8).to(torch.float8_e4m3fn)
    s2 = torch.tensor([[0.5, 0.003], [1.25, 7.0]])
    got = fp4.nvfp4_dequantize(fp4.pack(codes), s, s2, torch.float32, row_segments=(8, 4))
    want = torch.tensor(TABLE)[codes.long()] * s.float().repeat_interleave(16, -1)
    want = want * torch.cat([s2[:, :1].expand(2, 8), s2[:, 1:].expand(2, 4)], 1)[..., None]
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="2 global scales for 1"):
        fp4.nvfp4_dequantize(fp4.pack(codes), s, s2, torch.float32)
    one = fp4.nvfp4_dequantize(fp4.pack(codes[0]), s[0], torch.tensor(0.5), torch.float32)
    assert torch.equal(one, torch.tensor(TABLE)[codes[0].long()] * s[0].float().repeat_interleave(16, -1) * 0.5)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantize_roundtrip(fmt):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 64, 96, generator=g)
    w[0, :3, :16] *= 100  # one group with a large range: its scale must not leak into the neighbours
    if fmt == "mxfp4":
        q, e = fp4.mxfp4_quantize(w)
        assert q.shape == (2, 64, 48) and e.shape == (2, 64, 3) and q.dtype == e.dtype == torch.uint8
        d = fp4.mxfp4_dequantize(q, e, torch.float32)
        assert torch.equal(fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(d), torch.float32), d)  # representable: kept
    else:
        q, s, s2 = fp4.nvfp4_quantize(w, row_segments=(32, 32))
        assert q.shape == (2, 64, 48) and s.shape == (2, 64, 6) and s2.shape == (2, 2) and s.dtype == torch.float8_e4m3fn
        d = fp4.nvfp4_dequantize(q, s, s2, torch.float32, row_segments=(32, 32))
        assert torch.equal(s2[0, 1], w[0, 32:].abs().amax() / (6 * 448))   # ModelOpt's global scale, per projection
    # E2M1 has 1 mantissa bit: each element within a quarter of its group's largest (plus e4m3 scale error)
    groups = w.reshape(2, 64, -1, 16 if fmt == "nvfp4" else 32)
    err = (d - w).abs().reshape(groups.shape).amax(-1) / groups.abs().amax(-1)
    assert float(err.max()) < 0.3
    assert float((d[1] - w[1]).abs().mean() / w[1].abs().mean()) < 0.12


def test_fp4_declarations_deepseek_v3_and_gpt_oss_shapes():
    gate_up = NVFP4_SCHEME.expert_tensors("gate_up_proj", (2 * 2048, 7168), (2048, 2048))
    assert [(t.name, t.role, t.dtype, t.expert_shape) for t in gate_up] == [
        ("gate_up_proj", TensorRole.WEIGHT, "uint8", (4096, 3584)),
        ("gate_up_proj_weight_scale", TensorRole.SCALE, "float8_e4m3fn", (4096, 448)),
        ("gate_up_proj_weight_scale_2", TensorRole.SCALE, "float32", (2,)),
    ]
    w, s = MXFP4_SCHEME.expert_tensors("gate_up_proj", (5760, 2880))   # gpt-oss-120b
    assert (w.expert_shape, s.expert_shape, w.expert_bytes(2), s.expert_bytes(2)) == (
        (5760, 90, 16), (5760, 90), 5760 * 1440, 5760 * 90)
    with pytest.raises(ValueError, match="not a whole number of 32-element mxfp4 groups"):
        MXFP4_SCHEME.expert_tensors("down_proj", (64, 48))


def test_fp4_configs_accepted():
    gpt_oss = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    qc = parse_quantization_config(gpt_oss)
    assert qc.scheme is MXFP4_SCHEME and qc.modules_to_not_convert == ("model.layers.*.self_attn", "lm_head")
    hf_quant = {"producer": {"name": "modelopt", "version": "0.21.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]}}
    qc = parse_quantization_config(modelopt_config_from_hf_quant(hf_quant))
    assert qc.scheme.format is QuantFormat.NVFP4 and qc.modules_to_not_convert[1] == "model.layers.0.self_attn*"
    newer = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                           "input_activations": {"dynamic": False, "group_size": 16}}}}
    assert parse_quantization_config(newer).scheme is NVFP4_SCHEME
    for fmt in ("mxfp4", "nvfp4"):
        assert parse_quantization_config(fp4_config_dict(fmt, ("lm_head",))).scheme.format.value == fmt
    with pytest.raises(UnsupportedQuantizationError, match="group sizes"):
        parse_quantization_config(dict(newer, config_groups={"a": {"weights": {"group_size": 16}},
                                                             "b": {"weights": {"group_size": 32}}}))


def test_fp4_memory_is_a_quarter_of_bf16_plus_scales():
    """Qwen3-30B-A3B shapes (128 experts, H 2048, I 768), 4 ranks of 32: local bytes by part."""
    params = [("gate_up_proj", (2 * 768, 2048), (768, 768)), ("down_proj", (2048, 768), ())]
    kw = dict(num_moe_layers=48, num_experts=128, ranges=[(0, 32)], rank=0, slots=2, granularity=2 << 20)
    from dwdp_runtime.quant import UNQUANTIZED

    bf16 = expert_memory(tensors=layer_tensors(UNQUANTIZED, params), **kw)
    nv = expert_memory(tensors=layer_tensors(NVFP4_SCHEME, params), **kw)
    mx = expert_memory(tensors=layer_tensors(MXFP4_SCHEME, params), **kw)
    assert nv.weights == mx.weights == bf16.weights // 4
    per_expert_nv = 1536 * 128 + 2 * 4 + 2048 * 48 + 4
    # each scale tensor its own handle, rounded up to a granule
    want = 48 * sum(layout.composite_layout(num_experts=128, expert_bytes=b, local_range=(0, 32),
                                            granularity=2 << 20).local_bytes for b in (1536 * 128, 8, 2048 * 48, 4))
    assert nv.scales == want and nv.scales >= 48 * 32 * per_expert_nv
    assert mx.scales < nv.scales and nv.pool < bf16.pool


@pytest.mark.parametrize("dtype, scheme", [("nvfp4", NVFP4_SCHEME), ("mxfp4", MXFP4_SCHEME)])
def test_planner_fp4_memory_is_the_declared_layout(dtype, scheme):
    """``dwdp plan --dtype nvfp4|mxfp4`` and the operator's memory check count what a rank of an FP4 checkpoint
    maps: half a byte per weight, the scale handles, the pool pages of the packed tensors, dense in bf16."""
    from dwdp_runtime.planner import memory
    from dwdp_runtime.planner.model_shapes import load_model

    shape = load_model("deepseek-v3")
    ranges = layout.peer_ranges(dwdp_size=4, num_experts=256, num_experts_per_worker=64, num_prefetch_experts=64)
    bd = memory.breakdown(model="deepseek-v3", dtype=dtype, hardware="h200-hgx", ranges=list(ranges),
                          experts_per_worker=64, prefetch_slots=2)
    i, h = shape.moe_inter, shape.hidden
    tensors = layer_tensors(scheme, [("gate_up_proj", (2 * i, h), (i, i)), ("down_proj", (h, i), ())])
    mem = expert_memory(tensors=tensors, num_moe_layers=shape.num_moe_layers, num_experts=256, ranges=ranges,
                        rank=0, slots=1, granularity=2 << 20)
    assert bd.local_experts == mem.weights == shape.num_moe_layers * 64 * 3 * i * h // 2   # two E2M1 per byte
    assert bd.local_expert_scales == mem.scales >= shape.num_moe_layers * 64 * 3 * i * h // scheme.block[1]
    fp8 = memory.breakdown(model="deepseek-v3", dtype="fp8", hardware="h200-hgx", ranges=list(ranges),
                           experts_per_worker=64, prefetch_slots=2)
    assert bd.pool_slots < fp8.pool_slots and bd.dense_weights == fp8.dense_weights   # dense dequantized to bf16
    fits, message, _ = memory.memory_fit(model="deepseek-r1", dtype=dtype, hardware="h200", dwdp_size=4,
                                         experts_per_worker=64, prefetch_stride=64, prefetch_slots=2)
    assert fits and "local experts 76.1 (k=64)" in message   # FP8 (152 GiB) does not fit at d = 4


def test_dwdp_plan_mxfp4_gpt_oss_on_h200(capsys):
    import json

    from dwdp_runtime.cli import main

    assert main(["plan", "--model", "gpt-oss-120b", "--dtype", "mxfp4", "--hardware", "h200", "--dwdp-size", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "mxfp4"
    bf16 = memory_gib("bf16")
    assert out["memory_gib"]["local_experts"] == pytest.approx(bf16["local_experts"] / 4, rel=0.01)
    assert 0 < out["memory_gib"]["local_expert_scales"] < out["memory_gib"]["local_experts"] / 8


def memory_gib(dtype: str) -> dict:
    from dwdp_runtime.planner.plan import plan

    return plan(model="gpt-oss-120b", dtype=dtype, hardware="h200", dwdp_size=2, with_crossover=False,
                with_recommendation=False).memory_gib


def test_deepseek_v4_fp4_experts_declaration_and_config():
    from dwdp_runtime.quant import FP4_UE8M0_SCHEME

    v4 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert parse_quantization_config(v4).scheme is FP4_UE8M0_SCHEME
    assert parse_quantization_config(fp4_config_dict("fp4-ue8m0")) == parse_quantization_config(v4)
    w, s = FP4_UE8M0_SCHEME.expert_tensors("gate_up_proj", (2 * 2048, 7168), (2048, 2048))
    assert (w.dtype, w.expert_shape, s.name, s.dtype, s.expert_shape) == (
        "int8", (4096, 3584), "gate_up_proj_scale_inv", "float8_e8m0fnu", (4096, 224))
    with pytest.raises(UnsupportedQuantizationError, match="expert_dtype 'fp4' with scale_fmt None"):
        parse_quantization_config({k: v for k, v in v4.items() if k != "scale_fmt"})
    with pytest.raises(UnsupportedQuantizationError, match="scale_fmt 'ue8m0' with FP8 experts"):
        parse_quantization_config(dict(v4, expert_dtype="fp8"))
