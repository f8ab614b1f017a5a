"""Architecture registry and synthetic checkpoints (single process, no DWDP group)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dwdp_worker import models as arch
from dwdp_worker.loader import build_meta_model, load_config
from dwdp_worker.safetensors_index import SafetensorsIndex
from dwdp_worker.synth import add_synth_arguments, synth_main, write_synthetic

# MoE layers per architecture in the default 3-layer synthetic config (dense layers run unchanged)
MOE_LAYERS = {"qwen3_moe": [0, 2], "mixtral": [0, 1, 2], "deepseek_v3": [1, 2]}


@pytest.mark.parametrize("name", sorted(MOE_LAYERS))
def test_experts_sites_and_checkpoint_keys(name, checkpoints):
    config = load_config(checkpoints[name])
    model = build_meta_model(config, torch.float32)
    sites = arch.experts_sites(model)
    assert [s.layer for s in sites] == MOE_LAYERS[name]
    spec = arch.arch_spec(name)
    with SafetensorsIndex(checkpoints[name]) as ckpt:
        for s in sites:
            for w in arch.EXPERT_WEIGHTS:
                for e in range(8):
                    keys = arch.expert_ckpt_keys(spec, s.name, w, e)
                    assert all(k in ckpt for k in keys), keys
                    rows = sum(ckpt.shape(k)[0] for k in keys)
                    assert rows == s.module._parameters[w].shape[1]
        # replicated per-expert tensors (routers, DeepSeek-V3's score-correction bias) exist per MoE layer
        for s in sites:
            layer_prefix = arch.to_ckpt_name(spec, s.name).rsplit(".experts", 1)[0].rsplit(".", 1)[0]
            for suffix in spec.replicated_per_expert:
                assert f"{layer_prefix}.{suffix}" in ckpt


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
    with pytest.raises(SystemExit):
        parser.parse_args(["llama", "--out", str(tmp_path)])
    assert synth_main(parser.parse_args(["mixtral", "--out", str(tmp_path / "m"), "--tokenizer"])) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_unsupported_and_quantized_models_are_refused():
    from transformers import LlamaConfig, Qwen3MoeConfig

    with pytest.raises(arch.UnsupportedModelError, match="not supported by DWDP"):
        arch.check_supported_config(LlamaConfig())
    q = Qwen3MoeConfig(num_experts=4)
    q.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(arch.UnsupportedModelError, match="quantized"):
        arch.check_supported_config(q)


@pytest.mark.parametrize("name", sorted(MOE_LAYERS))
def test_dense_weights_match_from_pretrained_in_bf16(name, checkpoints):
    """Values and dtypes of every dense tensor equal from_pretrained's (incl. DeepSeek-V3's fp32-kept bias)."""
    from dwdp_worker.loader import load_dense
    from dwdp_worker.oracle import Reference

    config = load_config(checkpoints[name])
    model = build_meta_model(config, torch.bfloat16)
    with SafetensorsIndex(checkpoints[name]) as ckpt:
        load_dense(model, arch.arch_spec(name), ckpt, torch.device("cpu"), dtype=torch.bfloat16)
    ref = dict(Reference(checkpoints[name], dtype="bfloat16").model.state_dict())
    ours = {k: v for k, v in model.state_dict().items() if not arch.is_expert_param(k)}
    assert set(ours) == {k for k in ref if not arch.is_expert_param(k)}
    for k, v in ours.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k
    if name == "deepseek_v3":
        assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
