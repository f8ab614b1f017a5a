"""The quantization declaration, config parsing/refusals, block math and the per-part memory numbers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_runtime import layout
from dwdp_runtime.quant import (FP8_BLOCK_SCHEME, UNQUANTIZED, TensorRole, UnsupportedQuantizationError,
                                expert_memory, fp8_config_dict, layer_tensors, layers_memory,
                                parse_quantization_config)
from dwdp_runtime.quant import fp8_block

DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_fp8_declaration_deepseek_v3_shapes():
    gate_up = FP8_BLOCK_SCHEME.expert_tensors("gate_up_proj", (2 * 2048, 7168), (2048, 2048))
    down = FP8_BLOCK_SCHEME.expert_tensors("down_proj", (7168, 2048))
    assert [(t.name, t.role, t.dtype, t.expert_shape) for t in gate_up + down] == [
        ("gate_up_proj", TensorRole.WEIGHT, "float8_e4m3fn", (4096, 7168)),
        ("gate_up_proj_scale_inv", TensorRole.SCALE, "float32", (32, 56)),
        ("down_proj", TensorRole.WEIGHT, "float8_e4m3fn", (7168, 2048)),
        ("down_proj_scale_inv", TensorRole.SCALE, "float32", (56, 16)),
    ]
    assert gate_up[1].expert_bytes(2) == 32 * 56 * 4
    # unquantized: the parameter itself at the compute dtype
    (w,) = UNQUANTIZED.expert_tensors("down_proj", (7168, 2048))
    assert w.dtype is None and w.expert_bytes(2) == 7168 * 2048 * 2


def test_gate_up_scale_rows_are_per_projection():
    # I = 192 is not a multiple of 128: gate and up each need 2 scale rows (a fused ⌈384/128⌉ = 3 would be wrong)
    (_, s) = FP8_BLOCK_SCHEME.expert_tensors("gate_up_proj", (384, 256), (192, 192))
    assert s.expert_shape == (4, 2)
    with pytest.raises(ValueError, match="add up"):
        FP8_BLOCK_SCHEME.expert_tensors("gate_up_proj", (384, 256), (192, 100))


def test_accepts_released_configs():
    qc = parse_quantization_config(DEEPSEEK_V3)
    assert qc.scheme is FP8_BLOCK_SCHEME and qc.modules_to_not_convert == ()
    qwen = dict(DEEPSEEK_V3, modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate"])
    assert parse_quantization_config(qwen).modules_to_not_convert == ("lm_head", "model.layers.0.mlp.gate")
    no_fmt = {k: v for k, v in DEEPSEEK_V3.items() if k != "fmt"}  # transformers' own FineGrainedFP8Config
    assert parse_quantization_config(no_fmt).quantized
    assert not parse_quantization_config(None).quantized
    assert parse_quantization_config(fp8_config_dict(("lm_head",))).modules_to_not_convert == ("lm_head",)


def test_accepts_transformers_config_object():
    from transformers.utils.quantization_config import FineGrainedFP8Config

    assert parse_quantization_config(FineGrainedFP8Config()).scheme is FP8_BLOCK_SCHEME


@pytest.mark.parametrize("bad, says", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "compressed-tensors config_groups None"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "NVFP4 group_size 32"),
    ({"quant_method": "mxfp4", "activation_scheme": "static"}, "static activation scales"),
    (dict(DEEPSEEK_V3, activation_scheme="static"), "static activation scales"),
    (dict(DEEPSEEK_V3, weight_block_size=[64, 64]), r"\[64, 64\] is not supported"),
    (dict(DEEPSEEK_V3, weight_block_size=None), "per-tensor"),
    (dict(DEEPSEEK_V3, fmt="e5m2"), "'e5m2'"),
    (dict(DEEPSEEK_V3, scale_fmt="ue8m0"), "ue8m0"),
    (dict(DEEPSEEK_V3, expert_dtype="fp4"), "fp4"),
])
def test_refusals_name_what_is_supported(bad, says):
    with pytest.raises(UnsupportedQuantizationError, match=says) as exc:
        parse_quantization_config(bad)
    assert "weight_block_size=[128, 128]" in str(exc.value) and "dynamic" in str(exc.value)
    assert "mxfp4" in str(exc.value) and "quant_algo='NVFP4', group_size=16" in str(exc.value)


@pytest.mark.parametrize("shape, segs", [((256, 384), None), ((200, 130), None), ((2 * 96, 40), (96, 96)),
                                         ((3, 2 * 192, 256), (192, 192))])
def test_quantize_dequantize_roundtrip(shape, segs):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    w[..., :5, :7] *= 1000  # one block with a large range: its scale must not leak into the neighbours
    q, s = fp8_block.quantize(w, row_segments=segs)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.shape == w.shape
    rows = sum(-(-n // 128) for n in (segs or (shape[-2],)))
    assert s.shape == (*shape[:-2], rows, -(-shape[-1] // 128))
    back = fp8_block.dequantize(q, s, torch.float32, row_segments=segs)
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of its block's amax-scaled value
    scale = fp8_block.expand_scales(s, shape[-2], shape[-1], row_segments=segs)
    assert torch.all((back - w).abs() <= scale * 448 * 2**-4 + 1e-12)
    assert float((back - w).abs().max()) > 0  # it really is quantized
    # an all-zero block has scale 1 and dequantizes to exact zeros
    z = torch.zeros(128, 128)
    qz, sz = fp8_block.quantize(z)
    assert float(sz) == 1.0 and not fp8_block.dequantize(qz, sz, torch.bfloat16).any()


def test_dequantize_refuses_mismatched_grid():
    q = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale grid"):
        fp8_block.dequantize(q, torch.ones(3, 2), torch.float32)


@pytest.mark.parametrize("d, k, s", [(2, 5, 3), (3, 3, 3), (4, 3, 2)])
def test_small_scale_tensors_lay_out_like_any_expert(d, k, s):
    """Scale experts are far below a page (and below the granularity): every byte still has one place."""
    ranges = layout.peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
    for eb in (4, 8, 7168):  # a 1×1 fp32 scale, 1×2, DeepSeek-V3 gate_up scale
        for rank in range(d):
            lay, ops, setup = layout.copy_plan(num_experts=8, expert_bytes=eb, rank=rank, ranges=ranges,
                                               granularity=4096)
            covered = sorted((op.dst_offset - lay.pre_padding, op.dst_offset - lay.pre_padding + op.nbytes)
                             for op in ops + setup)
            a, b = ranges[rank]
            local = (a * eb, b * eb)
            pieces = sorted(covered + [local])
            assert pieces[0][0] == 0 and pieces[-1][1] == 8 * eb
            assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:])), pieces


def test_expert_memory_by_part_matches_layout():
    tensors = layer_tensors(FP8_BLOCK_SCHEME, [("gate_up_proj", (4096, 7168), (2048, 2048)),
                                               ("down_proj", (7168, 2048), ())])
    ranges = layout.peer_ranges(dwdp_size=4, num_experts=256, num_experts_per_worker=64, num_prefetch_experts=64)
    mem = expert_memory(tensors=tensors, num_moe_layers=58, num_experts=256, ranges=ranges, rank=1, slots=2,
                        granularity=2 << 20)
    assert mem.weights == 58 * 64 * (4096 * 7168 + 7168 * 2048)       # fp8: 1 byte, already granule multiples
    # scales: 64 × 7 KiB and 64 × 3.5 KiB, each rounded up to one 2 MiB granule
    assert mem.scales == 58 * 2 * (2 << 20)
    assert mem.pool > 0 and mem.pool % (16 << 20) == 0


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 8), st.integers(1, 64), st.integers(0, 7), st.integers(1, 4), st.integers(0, 70),
       st.sampled_from([UNQUANTIZED, FP8_BLOCK_SCHEME]), st.sampled_from([4096, 2 << 20]))
def test_expert_memory_of_identical_layers_is_layers_memory_of_them(d, experts_per_rank, rank_seed, slots, layers,
                                                                    scheme, granularity):
    """``expert_memory`` computes one layer and scales it (the planner asks it thousands of times per plan): the
    result must be ``layers_memory`` of the repeated layer, exactly, for any sharding, slots and layer count."""
    num_experts = d * experts_per_rank
    ranges = layout.peer_ranges(dwdp_size=d, num_experts=num_experts, num_experts_per_worker=experts_per_rank,
                                num_prefetch_experts=experts_per_rank)
    tensors = layer_tensors(scheme, [("gate_up_proj", (384, 256), (192, 192)), ("down_proj", (256, 192), ())])
    rank = rank_seed % d
    kw = dict(num_experts=num_experts, ranges=ranges, rank=rank, slots=slots, granularity=granularity)
    assert expert_memory(tensors=tensors, num_moe_layers=layers, **kw) == layers_memory(layers=[tensors] * layers, **kw)


def test_planner_fp8_memory_is_the_declared_layout():
    """``dwdp plan --dtype fp8`` (and the operator's memory check, which calls ``memory_fit``) count what a rank
    of an FP8 checkpoint maps: e4m3 weights, fp32 scale handles, pool pages, dense dequantized to bf16."""
    from dwdp_runtime.planner import memory
    from dwdp_runtime.planner.model_shapes import load_model

    shape = load_model("deepseek-v3")
    ranges = layout.peer_ranges(dwdp_size=8, num_experts=256, num_experts_per_worker=32, num_prefetch_experts=32)
    bd = memory.breakdown(model="deepseek-v3", dtype="fp8", hardware="h200-hgx", ranges=list(ranges),
                          experts_per_worker=32, prefetch_slots=2)
    i, h = shape.moe_inter, shape.hidden
    tensors = layer_tensors(FP8_BLOCK_SCHEME, [("gate_up_proj", (2 * i, h), (i, i)), ("down_proj", (h, i), ())])
    mem = expert_memory(tensors=tensors, num_moe_layers=shape.num_moe_layers, num_experts=256, ranges=ranges,
                        rank=0, slots=1, granularity=2 << 20)
    assert bd.local_experts == mem.weights == shape.num_moe_layers * 32 * 3 * i * h   # 1 byte per e4m3 weight
    assert bd.local_expert_scales == mem.scales == shape.num_moe_layers * 2 * (2 << 20)
    assert bd.pool_slots == 2 * max(expert_memory(tensors=tensors, num_moe_layers=1, num_experts=256, ranges=ranges,
                                                  rank=r, slots=1, granularity=2 << 20).pool for r in range(8))
    bf16_dense = memory.breakdown(model="deepseek-v3", dtype="bf16", hardware="h200-hgx", ranges=list(ranges),
                                  experts_per_worker=32, prefetch_slots=2).dense_weights
    assert bd.dense_weights == bf16_dense  # FP8 dense linears are dequantized to bf16 at load
    fits, message, _ = memory.memory_fit(model="deepseek-v3", dtype="fp8", hardware="h200-hgx", dwdp_size=8,
                                         experts_per_worker=32, prefetch_stride=32, prefetch_slots=2)
    assert fits and "scales 0.23" in message
