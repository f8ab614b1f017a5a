"""Float32-kept RMSNorms in a bf16 model (``model.layers_impl.install_dtype_keeping_norms``): transformers 5.17's canonical norm forward hands
float32 to the next bf16 linear; the installed forward casts back, as later releases do."""

from __future__ import annotations

import pytest
import torch
import transformers

from dwdp_worker.model import layers_impl
from dwdp_worker.model.meta_model import build_meta_model
from dwdp_worker.model.synth_config import serving_auto_class, tiny_config

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


class KeptNormsQwen3Moe(transformers.Qwen3MoeForCausalLM):
    """A real Qwen3-MoE whose class keeps its RMSNorms in float32, as DeepSeek-V4's does (Qwen3's norm forward is
    the canonical one in every release, so this reproduces 5.17's DeepSeek-V4 on any transformers)."""
    _keep_in_fp32_modules_strict = ["input_layernorm", "post_attention_layernorm", "norm"]


def _kept_norms_model():
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe")
    model = KeptNormsQwen3Moe(config).to(torch.bfloat16).eval()
    for name, module in model.named_modules():
        if layers_impl._is_kept(name, layers_impl.kept_fp32_names(model)):
            module.to(torch.float32)
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    return model


def test_a_float32_kept_canonical_norm_breaks_a_bf16_forward_until_installed():
    model = _kept_norms_model()
    with pytest.raises(RuntimeError, match="dtype"):
        model(input_ids=IDS)
    n = layers_impl.install_dtype_keeping_norms(model)
    layers = model.config.num_hidden_layers
    assert n == 2 * layers + 1
    logits = model(input_ids=IDS).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_the_installed_forward_is_the_later_release_math():
    model = _kept_norms_model()
    layers_impl.install_dtype_keeping_norms(model)
    norm = model.model.norm
    x = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    h = x.float()
    want = (norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))).bfloat16()
    got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # a float32 input: the same arithmetic as the class's own forward, bit for bit
    x32 = torch.randn(4, model.config.hidden_size)
    assert torch.equal(norm(x32), type(norm).forward(norm, x32))


def test_norms_that_follow_the_model_dtype_keep_their_class_forward():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_config("qwen3_moe")).to(torch.bfloat16)
    assert layers_impl.install_dtype_keeping_norms(model) == 0
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_bf16_deepseek_v4_meta_model_and_oracle_build_run_on_this_transformers():
    """On 5.17 the installed forwards make it run; on a release that casts back itself nothing is installed."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config = tiny_config("deepseek_v4")
    meta = build_meta_model(config, torch.bfloat16)
    kept = sum("forward" in vars(m) for m in meta.modules())
    canonical = layers_impl._forward_is_canonical_norm(type(meta.model.norm))
    assert (kept > 0) == canonical
    torch.manual_seed(0)
    model = serving_auto_class(config).from_config(config, dtype=torch.bfloat16).eval()
    layers_impl.install_dtype_keeping_norms(model)
    logits = model(input_ids=IDS).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
