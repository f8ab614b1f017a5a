"""compressed-tensors NVFP4 configs (llm-compressor): parsed to the ModelOpt path's ``NVFP4_SCHEME`` with the
checkpoint's names and inverse global scale carried in ``QuantConfig.nvfp4``; everything else refused, naming
what is supported; the planner sizes such a checkpoint as ``--dtype nvfp4``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dwdp_runtime import layout
from dwdp_runtime.quant import (COMPRESSED_TENSORS_NVFP4, MODELOPT_NVFP4, NVFP4_SCHEME, SUPPORTED, GlobalScale,
                                ModulePatterns, Nvfp4Part, UnsupportedQuantizationError, expert_memory, fp4,
                                fp4_config_dict, layer_tensors, parse_quantization_config)

WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
           "dynamic": False, "actorder": None, "block_structure": None, "observer": "static_minmax",
           "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
#: llm-compressor's NVFP4A16 preset as a Qwen3-MoE config.json carries it
W4A16 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
         "global_compression_ratio": None, "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
         "version": "0.12.2", "ignore": ["lm_head", "re:.*mlp.gate$"],
         "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                       "weights": WEIGHTS, "input_activations": None, "output_activations": None}}}
#: the NVFP4 (W4A4) preset: activations 4-bit float per 16, dynamic local scales under a static global one
W4A4 = copy.deepcopy(W4A16)
W4A4["config_groups"]["group_0"]["input_activations"] = dict(WEIGHTS, dynamic="local", observer="minmax",
                                                             scale_dtype=None)


def _with(base, path, value):
    """``base`` with ``path`` (keys) set to ``value`` (None path item: delete)."""
    out = copy.deepcopy(base)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()
G = ("config_groups", "group_0")


def test_nvfp4a16_is_the_nvfp4_scheme_with_compressed_tensors_names():
    qc = parse_quantization_config(W4A16)
    assert qc.scheme is NVFP4_SCHEME and qc.quantized
    assert qc.nvfp4.names is COMPRESSED_TENSORS_NVFP4
    assert (qc.nvfp4.names.weight, qc.nvfp4.names.scale, qc.nvfp4.names.global_scale) == (
        "weight_packed", "weight_scale", "weight_global_scale")
    assert qc.nvfp4.names.global_kind is GlobalScale.DIVISOR and MODELOPT_NVFP4.global_kind is GlobalScale.MULTIPLIER
    assert qc.modules_to_not_convert == ("lm_head", "re:.*mlp.gate$")
    # ModelOpt's NVFP4 is the same scheme under ModelOpt's names
    mo = parse_quantization_config(fp4_config_dict("nvfp4", ("lm_head",)))
    assert mo.scheme is qc.scheme and mo.nvfp4.names is MODELOPT_NVFP4


def test_w4a4_is_served_weight_only_like_w4a16():
    """The activation quantization of the NVFP4 (W4A4) preset is not applied (Hopper: weight-only, as ModelOpt's
    input_scale): the parsed config is the W4A16 one's, so the two load the same."""
    assert parse_quantization_config(W4A4) == parse_quantization_config(W4A16)
    static = _with(W4A4, (*G, "input_activations", "dynamic"), False)   # a static activation global scale
    assert parse_quantization_config(static) == parse_quantization_config(W4A16)


@pytest.mark.parametrize("variant", [
    _with(W4A16, ("format",), "mixed-precision"),            # groups name their own format
    _with(W4A16, ("format",), _DELETE),
    _with(_with(W4A16, (*G, "format"), _DELETE), ("quantization_status",), _DELETE),   # older configs
    _with(W4A16, (*G, "weights", "scale_dtype"), _DELETE),
    _with(W4A16, ("sparsity_config",), None),
    _with(W4A16, ("config_groups", "group_1"), {"targets": ["re:.*experts.*"], "weights": WEIGHTS}),
])
def test_accepted_variants(variant):
    assert parse_quantization_config(variant).nvfp4.names is COMPRESSED_TENSORS_NVFP4


@pytest.mark.parametrize("path, value, says", [
    (("format",), "pack-quantized", "format 'pack-quantized' is not supported"),             # int4 (GPTQ/AWQ)
    (("format",), "float-quantized", "format 'float-quantized'"),                             # FP8
    ((*G, "format"), "mxfp4-pack-quantized", "format 'mxfp4-pack-quantized'"),
    (("format",), "mixed-precision", None),   # placeholder (replaced below: a group without its own format)
    ((*G, "weights", "num_bits"), 8, "weights.num_bits 8 is not supported"),
    ((*G, "weights", "type"), "int", "weights.type 'int'"),
    ((*G, "weights", "strategy"), "group", "weights.strategy 'group'"),
    ((*G, "weights", "group_size"), 32, "weights.group_size 32"),
    ((*G, "weights", "symmetric"), False, "symmetric False .a zero point."),
    ((*G, "weights", "dynamic"), True, "weights.dynamic True"),
    ((*G, "weights", "actorder"), "group", "actorder 'group'"),
    ((*G, "weights", "scale_dtype"), "torch.bfloat16", "scale_dtype 'torch.bfloat16'"),
    ((*G, "weights"), None, "quantizes no weights"),
    ((*G, "input_activations"), {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
     "input_activations.num_bits 8"),                                                         # W4A8 (fp8 acts)
    ((*G, "output_activations"), dict(WEIGHTS), "output_activations"),
    (("config_groups",), {}, "config_groups {}"),
    (("quantization_status",), "frozen", "quantization_status 'frozen'"),
    (("sparsity_config",), {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}, "sparsity_config"),
    (("transform_config",), {"config_groups": {"u": {"type": "hadamard"}}}, "transform_config"),
    (("ignore",), "lm_head", "ignore 'lm_head' must be a list"),
    (("ignore",), ["re:(unclosed"], r"ignore entry 're:\(unclosed' is not a regular expression"),
])
def test_refusals_name_the_field_and_what_is_supported(path, value, says):
    bad = _with(W4A16, path, value)
    if says is None:   # a top-level mixed-precision format needs every group to name its own
        bad = _with(bad, (*G, "format"), _DELETE)
        says = "format 'mixed-precision'"
    with pytest.raises(UnsupportedQuantizationError, match=says) as exc:
        parse_quantization_config(bad)
    assert SUPPORTED in str(exc.value)
    assert "format='nvfp4-pack-quantized'" in str(exc.value) and "quant_algo='NVFP4', group_size=16" in str(exc.value)


def test_module_patterns_match_as_compressed_tensors_does():
    """``re:`` entries match from the start of the name (``re.match``), plain ones the whole name; a plain class
    name never matches a module name; the first matching entry is named."""
    p = ModulePatterns.parse(["lm_head", "re:.*mlp.gate$", "re:model.layers.1.", "Linear"], "ignore")
    assert p.matches("lm_head") == "lm_head"
    assert p.matches("model.layers.3.mlp.gate") == "re:.*mlp.gate$"
    assert p.matches("model.layers.3.mlp.gate_proj") is None            # $ anchors the end
    assert p.matches("model.layers.1.self_attn.q_proj") == "re:model.layers.1."
    assert p.matches("x.model.layers.1.self_attn.q_proj") is None       # match, not search
    assert p.matches("model.lm_head") is None and p.matches("Linear") == "Linear"
    assert ModulePatterns.parse(None, "ignore").matches("lm_head") is None


def test_names_translate_part_by_part():
    for names in (MODELOPT_NVFP4, COMPRESSED_TENSORS_NVFP4):
        assert [names.part_of(names.leaf(p)) for p in Nvfp4Part] == list(Nvfp4Part)
    assert COMPRESSED_TENSORS_NVFP4.part_of("weight") is None        # an ignored module's unquantized weight
    assert MODELOPT_NVFP4.part_of("weight_packed") is None


def test_inverse_global_is_the_correctly_rounded_float32_reciprocal():
    """``weight_scale_2 = fl32(1 / weight_global_scale)`` (vLLM's ``1.0 / weight_global_scale``): over a wide
    range of float32 values (llm-compressor's ``448 · 6 / amax`` included) it is the float64 reciprocal rounded
    once to float32 (double rounding is innocuous for a quotient: 53 ≥ 2 · 24 + 2)."""
    rng = np.random.default_rng(0)
    g = np.concatenate([np.float32(448 * 6) / rng.uniform(1e-3, 10, 20000).astype(np.float32),
                        rng.uniform(1, 2, 20000).astype(np.float32) * np.float32(2.0) ** rng.integers(-60, 60, 20000),
                        np.array([1, 2, 0.5, 3, 7], dtype=np.float32)]).astype(np.float32)
    want = (1.0 / g.astype(np.float64)).astype(np.float32)
    got = fp4.nvfp4_inverse_global(torch.from_numpy(g)).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert float(fp4.nvfp4_inverse_global(torch.tensor([3.0]))) != 1 / 3   # a real rounding, not exact
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="no finite inverse"):
            fp4.nvfp4_inverse_global(torch.tensor([2.0, bad]))


def test_ct_dequantization_is_modelopts_with_the_inverse():
    """A compressed-tensors linear (codes, e4m3 scales, g) dequantizes to ModelOpt's math with s2 = fl32(1/g):
    ``(e2m1 · s) · s2`` — computed here from the E2M1 table and float64."""
    g_ = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (4, 32), generator=g_, dtype=torch.uint8)
    packed = fp4.pack(codes)
    s = (torch.randint(1, 120, (4, 2), generator=g_).to(torch.uint8)).view(torch.float8_e4m3fn)
    g = torch.tensor([1337.0], dtype=torch.float32)
    s2 = fp4.nvfp4_inverse_global(g)
    got = fp4.nvfp4_dequantize(packed, s, s2, torch.float32)
    e2m1 = np.array(fp4.E2M1_VALUES)[codes.numpy()]
    want = (e2m1 * np.repeat(s.to(torch.float32).numpy().astype(np.float64), 16, axis=1)
            * np.float64(s2.item())).astype(np.float32)
    assert np.array_equal(got.numpy(), want)


def test_planner_sizes_a_ct_checkpoint_as_nvfp4(capsys):
    """``dwdp plan --dtype nvfp4`` is unchanged and is what a compressed-tensors NVFP4 checkpoint maps: the planner's
    nvfp4 declaration is the parsed scheme itself, and its memory figures are the declared tensors'."""
    import json

    from dwdp_runtime.cli import main
    from dwdp_runtime.planner import memory
    from dwdp_runtime.planner.model_shapes import load_model

    scheme = parse_quantization_config(W4A16).scheme
    assert memory._DECLARED["nvfp4"] is scheme
    assert main(["plan", "--model", "deepseek-v3", "--dtype", "nvfp4", "--hardware", "h200-hgx", "--dwdp-size",
                 "4", "--experts-per-worker", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shape = load_model("deepseek-v3")
    i, h = shape.moe_inter, shape.hidden
    ranges = layout.peer_ranges(dwdp_size=4, num_experts=256, num_experts_per_worker=64, num_prefetch_experts=64)
    mem = expert_memory(tensors=layer_tensors(scheme, [("gate_up_proj", (2 * i, h), (i, i)), ("down_proj", (h, i), ())]),
                        num_moe_layers=shape.num_moe_layers, num_experts=256, ranges=ranges, rank=0, slots=1,
                        granularity=2 << 20)
    assert out["dtype"] == "nvfp4"
    assert out["memory_gib"]["local_experts"] == pytest.approx(mem.weights / 2**30, abs=0.01)
    assert out["memory_gib"]["local_expert_scales"] == pytest.approx(mem.scales / 2**30, abs=0.01)
