"""Architecture registry and synthetic checkpoints (single process, no DWDP group)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dwdp_worker.model import registry as arch
from dwdp_worker.checkpoint.loader import build_meta_model, load_config
from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex
from dwdp_worker.checkpoint.synth import add_synth_arguments, synth_main, write_synthetic

# MoE layers per architecture in the default 3-layer synthetic config (dense layers run unchanged)
MOE_LAYERS = {"qwen3_moe": [0, 2], "mixtral": [0, 1, 2], "deepseek_v3": [1, 2]}


# per-expert checkpoint names save_pretrained writes (transformers' reverse conversion), per architecture
CKPT_PARTS = {"qwen3_moe": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
              "deepseek_v3": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
              "mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}}


@pytest.mark.parametrize("name", sorted(MOE_LAYERS))
def test_discovered_layout_and_checkpoint_keys(name, checkpoints):
    from dwdp_worker.checkpoint.names import CheckpointMap, resolve_sources
    from dwdp_worker.model.experts_layout import ParamRole, SourceKind

    config = load_config(checkpoints[name])
    model = build_meta_model(config, torch.float32)
    layout = arch.model_layout(model)
    assert layout.layers == MOE_LAYERS[name] and layout.num_experts == 8
    with SafetensorsIndex(checkpoints[name]) as ckpt:
        layout = resolve_sources(layout, CheckpointMap.build(model, ckpt.entries), ckpt.shape)
        for e in layout.experts:
            module = model.get_submodule(e.path)
            assert (e.is_transposed, e.has_gate, e.has_bias, e.is_concatenated) == (False, True, False, True)
            assert e.param_names == ("gate_up_proj", "down_proj")
            for p in e.params:
                assert p.role is ParamRole.WEIGHT and p.expert_shape == tuple(module._parameters[p.name].shape[1:])
                assert p.source.kind is SourceKind.PER_EXPERT and p.source.concat_dim == 0
                ckpt_block = e.path.replace(".mlp.", ".block_sparse_moe.") if name == "mixtral" else e.path
                for x in range(8):
                    keys = p.source.keys(x)
                    assert keys == [f"{ckpt_block}.{x}.{proj}.weight" for proj in CKPT_PARTS[name][p.name]]
                    assert sum(ckpt.shape(k)[0] for k in keys) == p.expert_shape[0]
            # the router (and DeepSeek-V3's score-correction bias, shared experts) are replicated
            block = e.path.rsplit(".", 1)[0]
            assert any(r.startswith(f"{block}.gate.") for r in e.replicated)
            assert not any(layout.is_sharded(r) for r in e.replicated)
            if name == "deepseek_v3":
                assert f"{block}.gate.e_score_correction_bias" in e.replicated
                assert any(".shared_experts." in r for r in e.replicated)


def test_fused_checkpoint_is_one_byte_range(checkpoints):
    from dwdp_worker.checkpoint.names import CheckpointMap, resolve_sources
    from dwdp_worker.model.experts_layout import SourceKind

    model = build_meta_model(load_config(checkpoints["qwen3_moe_fused"]), torch.float32)
    with SafetensorsIndex(checkpoints["qwen3_moe_fused"]) as ckpt:
        layout = resolve_sources(arch.model_layout(model), CheckpointMap.build(model, ckpt.entries), ckpt.shape)
    for e in layout.experts:
        for p in e.params:
            assert p.source.kind is SourceKind.FUSED and p.source.keys(3) == [e.full_name(p.name)]


def test_layout_takes_extra_per_expert_tensors(checkpoints):
    """A quantization method adds its per-expert tensors (e.g. FP8 scales) as more sharded parameters."""
    from dwdp_worker.model.experts_layout import ExpertParam, ParamRole

    model = build_meta_model(load_config(checkpoints["qwen3_moe"]), torch.float32)
    e = arch.model_layout(model).experts[0]
    scale = ExpertParam("gate_up_proj_scale_inv", ParamRole.of("gate_up_proj_scale_inv"), (1, 1), torch.float32)
    e2 = e.with_params(scale)
    assert e2.param_names == ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv")
    assert e2.param("gate_up_proj_scale_inv").role is ParamRole.SCALE and e.param_names == ("gate_up_proj", "down_proj")
    with pytest.raises(ValueError, match="already declared"):
        e2.with_params(scale)


def test_pread_reader_matches_safetensors(checkpoints):
    path = checkpoints["deepseek_v3"] / "model.safetensors"
    with SafetensorsIndex(checkpoints["deepseek_v3"]) as ckpt, safe_open(str(path), "pt") as f:
        for key in f.keys():
            assert torch.equal(ckpt.get(key), f.get_tensor(key)), key
        key = "model.layers.1.mlp.experts.3.gate_proj.weight"
        dst = torch.empty((2, *ckpt.shape(key)[1:]), dtype=torch.bfloat16)
        ckpt.read_rows(key, 1, 3, dst)  # staged path (dtype conversion)
        assert torch.equal(dst, f.get_tensor(key)[1:3].to(torch.bfloat16))


def test_synthetic_is_deterministic_per_seed(tmp_path):
    a = write_synthetic("mixtral", tmp_path / "a", seed=1, num_layers=2)
    b = write_synthetic("mixtral", tmp_path / "b", seed=1, num_layers=2)
    c = write_synthetic("mixtral", tmp_path / "c", seed=2, num_layers=2)
    with SafetensorsIndex(a) as ta, SafetensorsIndex(b) as tb, SafetensorsIndex(c) as tc:
        keys = sorted(ta.entries)
        assert keys == sorted(tb.entries) and any(".experts.0.w1.weight" in k for k in keys)
        assert all(torch.equal(ta.get(k), tb.get(k)) for k in keys)
        assert not all(torch.equal(ta.get(k), tc.get(k)) for k in keys)


def test_synth_sizes_and_dtype(tmp_path):
    out = write_synthetic("deepseek_v3", tmp_path / "d", num_experts=12, num_layers=4, hidden_size=64,
                          vocab_size=300, dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (12, 4, 64, 300)
    with SafetensorsIndex(out) as ckpt:
        assert ckpt.entries["model.layers.1.mlp.experts.11.down_proj.weight"].dtype == torch.bfloat16
        bias = ckpt.get("model.layers.1.mlp.gate.e_score_correction_bias")
        assert bias.shape == (12,) and bias.abs().sum() > 0  # non-zero so that routing depends on it


def test_synth_cli_errors_are_messages(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_synth_arguments(parser)
    assert synth_main(parser.parse_args(["qwen3_moe", "--out", str(tmp_path / "x"), "--num-experts", "1"])) == 2
    assert "num_experts must be >= 2" in capsys.readouterr().err
    assert synth_main(parser.parse_args(["llama", "--out", str(tmp_path / "l")])) == 2  # dense: nothing to shard
    assert "llama: the model has no experts module" in capsys.readouterr().err
    assert synth_main(parser.parse_args(["no_such_type", "--out", str(tmp_path / "n")])) == 2
    assert "not known to this transformers" in capsys.readouterr().err
    assert synth_main(parser.parse_args(["mixtral", "--out", str(tmp_path / "m"), "--tokenizer"])) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_unsupported_and_quantized_models_are_refused():
    from transformers import LlamaConfig, Qwen3MoeConfig

    dense = build_meta_model(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64,
                                         num_attention_heads=2), torch.float32)
    with pytest.raises(arch.UnsupportedModelError, match="'llama' is not supported by DWDP: .* no experts module"):
        arch.model_layout(dense)
    q = Qwen3MoeConfig(num_experts=4)
    q.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(arch.UnsupportedModelError, match="quantized"):
        arch.check_supported_config(q)


@pytest.mark.parametrize("name", sorted(MOE_LAYERS))
def test_dense_weights_match_from_pretrained_in_bf16(name, checkpoints):
    """Values and dtypes of every dense tensor equal from_pretrained's (incl. DeepSeek-V3's fp32-kept bias)."""
    from dwdp_worker.checkpoint.loader import load_dense
    from dwdp_worker.launch.oracle import Reference

    from dwdp_worker.checkpoint.names import CheckpointMap

    config = load_config(checkpoints[name])
    model = build_meta_model(config, torch.bfloat16)
    layout = arch.model_layout(model)
    with SafetensorsIndex(checkpoints[name]) as ckpt:
        load_dense(model, layout, CheckpointMap.build(model, ckpt.entries), ckpt, torch.device("cpu"),
                   dtype=torch.bfloat16)
    ref = dict(Reference(checkpoints[name], dtype="bfloat16").model.state_dict())
    ours = {k: v for k, v in model.state_dict().items() if not layout.is_sharded(k)}
    assert set(ours) == {k for k in ref if not layout.is_sharded(k)}
    for k, v in ours.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k
    if name == "deepseek_v3":
        assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_several_experts_modules_in_one_layer_are_refused_by_name(checkpoints):
    """A second experts module in a decoder layer (e.g. text and vision experts) is refused, naming both."""
    import copy

    model = build_meta_model(load_config(checkpoints["qwen3_moe"]), torch.float32)
    layer = model.model.layers[0]
    layer.vision_experts = copy.deepcopy(layer.mlp.experts)
    with pytest.raises(arch.UnsupportedModelError, match=r"decoder layer 0 has 2 experts modules "
                       r"\(model\.layers\.0\.mlp\.experts, model\.layers\.0\.vision_experts\)"):
        arch.model_layout(model)


def test_experts_outside_decoder_layers_are_refused_by_name(checkpoints):
    import copy

    model = build_meta_model(load_config(checkpoints["qwen3_moe"]), torch.float32)
    model.model.stray_experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    with pytest.raises(arch.UnsupportedModelError, match=r"'model\.stray_experts' .* not inside a decoder layer"):
        arch.model_layout(model)


def test_transposed_fused_checkpoint_goes_through_transformers_ops(tmp_path):
    """Qwen3-VL-MoE's rule Transpose(1, 2, check_dims): a checkpoint storing experts [E, in, out] (the layout its
    original releases use) is read per expert through transformers' own op, to the same model tensors."""
    from safetensors.torch import load_file, save_file

    from dwdp_worker.checkpoint.names import CheckpointMap, resolve_sources
    from dwdp_worker.checkpoint.loader import _expert_reader

    # expert FFN 48: [2I, H] = [96, 64] is not square, so the stored (transposed) shape tells transformers to transpose
    src = write_synthetic("qwen3_vl_moe", tmp_path / "v", seed=2,
                          config_overrides={"text_config": {"moe_intermediate_size": 48}})
    tensors = load_file(str(src / "model.safetensors"))
    experts = {k: v for k, v in tensors.items() if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert experts
    save_file({**tensors, **{k: v.transpose(1, 2).contiguous() for k, v in experts.items()}},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    model = build_meta_model(load_config(src), torch.float32)

    class Bar:
        def update(self, n):
            pass

    with SafetensorsIndex(src) as ckpt:
        layout = resolve_sources(arch.model_layout(model), CheckpointMap.build(model, ckpt.entries), ckpt.shape)
        for e in layout.experts:
            for p in e.params:
                assert p.source.slice_ops, p  # the stored shape differs: transformers' Transpose runs
                view = torch.empty((3, *p.expert_shape))
                _expert_reader(ckpt, e, p, Bar())(view, 2, 5)
                assert torch.equal(view, experts[p.source.fused_key][2:5])
