"""The fused non-expert layers (one-pass RMSNorm, one-launch RoPE) under Triton's CPU interpreter.

* ``rms_norm`` vs `transformers`' own Qwen3-MoE RMSNorm module: shapes of every use (hidden rows, the
  per-head q/k norms as ``[B, L, heads, D]`` views, DeepSeek-V3's 1536/512 low-rank norms), ragged row
  counts and non-power-of-two D, bf16 and fp32 inputs, bf16 and fp32 weights (result dtype as torch's);
  at most one rounding step apart, nearly all elements bitwise;
* a row's output is bitwise the same alone and inside a batch (batch invariance);
* ``apply_rope`` is **bitwise** `transformers`' ``apply_rotary_pos_emb``: transposed q/k views, GQA, one
  k head (DeepSeek-V3's MLA rope part), cos/sin broadcast over the batch, bf16 and fp32;
* ``layers_impl``: which classes/functions are recognised (Gemma's ``1 + weight`` norm is not), install
  and uninstall on a real model, and a whole tiny model through the kernels: RoPE swap bitwise, norms
  within rounding, CPU without the interpreter untouched.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _norm(d, dtype=torch.bfloat16, seed=0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    mod = Qwen3MoeRMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(seed)))
    return mod


def _step_bound(want: torch.Tensor, x_dtype) -> torch.Tensor:
    """How far a different summation order may move an output: one rounding step of the input dtype at
    ``want``'s magnitude for bf16 (the normalised value is rounded to it: 2^-7 relative at most), a few fp32
    ulps for fp32 (the sum of squares itself differs in its last bits: 2^-20 relative)."""
    rel = 2.0 ** -7 if x_dtype == torch.bfloat16 else 2.0 ** -20
    return want.float().abs() * rel + 1e-30


@pytest.mark.parametrize("rows,d", [(37, 2048), (5, 1536), (3, 512), (130, 128), (7, 100), (1, 7)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
def test_rms_norm_matches_transformers(rows, d, x_dtype, w_dtype):
    from dwdp_runtime.kernels.rmsnorm import rms_norm

    mod = _norm(d, w_dtype)
    x = (3 * torch.randn(rows, d, generator=torch.Generator().manual_seed(rows + d))).to(x_dtype)
    with torch.no_grad():
        want = mod(x)
        got = rms_norm(x, mod.weight, mod.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= _step_bound(want, x_dtype)).all()), diff.max()
    if x_dtype == torch.bfloat16:   # a tie flips only where the fp32 variance differs in its last bits
        assert (got == want).float().mean() >= 0.99


def test_rms_norm_on_head_views_and_strided_input():
    """q_norm's input is ``q_proj(x).view(B, L, heads, D)``; a transposed (non-contiguous) input works too."""
    from dwdp_runtime.kernels.rmsnorm import rms_norm

    mod = _norm(64)
    proj = torch.randn(2, 9, 4 * 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    heads = proj.view(2, 9, 4, 64)
    got = rms_norm(heads, mod.weight, mod.variance_epsilon)
    assert got.shape == heads.shape and got.is_contiguous()
    assert torch.equal(got, rms_norm(heads.reshape(-1, 64), mod.weight, mod.variance_epsilon).view(heads.shape))
    t = heads.transpose(1, 2)                      # [2, 4, 9, 64], not contiguous
    assert torch.equal(rms_norm(t, mod.weight, mod.variance_epsilon),
                       rms_norm(t.contiguous(), mod.weight, mod.variance_epsilon))
    assert rms_norm(torch.empty(0, 64).bfloat16(), mod.weight, 1e-6).shape == (0, 64)


def test_rms_norm_batch_invariant():
    from dwdp_runtime.kernels.rmsnorm import rms_norm

    mod = _norm(256)
    batch = torch.randn(301, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    packed = rms_norm(batch, mod.weight, 1e-6)
    for i in (0, 150, 300):
        assert torch.equal(rms_norm(batch[i:i + 1].clone(), mod.weight, 1e-6)[0], packed[i])


def _rope_inputs(b, heads, kv_heads, length, d, dtype, cos_batch=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, heads, d, generator=gen).to(dtype).transpose(1, 2)       # as the attention views
    k = torch.randn(b, length, kv_heads, d, generator=gen).to(dtype).transpose(1, 2)
    pos = torch.arange(length, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cb = b if cos_batch is None else cos_batch
    return q, k, ang.cos()[None].expand(cb, -1, -1).to(dtype), ang.sin()[None].expand(cb, -1, -1).to(dtype)


@pytest.mark.parametrize("b,heads,kv_heads,length,d,dtype,cos_batch", [
    (1, 4, 2, 33, 128, torch.bfloat16, None),   # Qwen3 / Mixtral GQA
    (2, 3, 1, 17, 64, torch.bfloat16, 1),       # DeepSeek-V3 rope part: one k head, cos shared by the batch
    (2, 2, 2, 5, 32, torch.float32, None),
])
def test_rope_bitwise_transformers(b, heads, kv_heads, length, d, dtype, cos_batch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    from dwdp_runtime.kernels.rope import apply_rope, supports

    q, k, cos, sin = _rope_inputs(b, heads, kv_heads, length, d, dtype, cos_batch)
    assert supports(q, k, cos, sin, 1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    def layout(t):  # strides of the dims that have more than one element (a size-1 dim's stride is free)
        return [st for st, n in zip(t.stride(), t.shape) if n > 1]

    assert layout(got_q) == layout(want_q) and layout(got_k) == layout(want_k)


def test_rope_refuses_what_it_does_not_compute():
    from dwdp_runtime.kernels.rope import supports

    q, k, cos, sin = _rope_inputs(1, 2, 2, 4, 64, torch.bfloat16)
    assert not supports(q, k, cos, sin, 2)                                 # heads not at dim 1
    assert not supports(q, k, cos.float(), sin.float(), 1)                 # type promotion
    q96, k96, c96, s96 = _rope_inputs(1, 2, 2, 4, 96, torch.bfloat16)
    assert not supports(q96, k96, c96, s96, 1)                             # half not a power of two


def test_recognised_variants():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from dwdp_worker.model import layers_impl

    assert all(layers_impl.norm_is_canonical(c) for c in (Qwen3MoeRMSNorm, MixtralRMSNorm, DeepseekV3RMSNorm))
    assert not layers_impl.norm_is_canonical(GemmaRMSNorm)          # (1 + weight): keeps its own

    class Scaled(Qwen3MoeRMSNorm):                                  # same name set, other math
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    Scaled.__name__ = "Qwen3MoeRMSNorm"
    assert not layers_impl.norm_is_canonical(Scaled)


@pytest.fixture
def tiny_qwen3():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p.float()))
    yield model
    from dwdp_worker.model import layers_impl

    layers_impl.uninstall(model)


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def test_install_on_a_model_and_uninstall(tiny_qwen3):
    import transformers.models.qwen3_moe.modeling_qwen3_moe as modeling

    from dwdp_worker.model import layers_impl

    original = modeling.apply_rotary_pos_emb
    done = layers_impl.install(tiny_qwen3)
    # per layer: input, post-attention, q_norm, k_norm; plus the final norm
    assert done.norms == 2 * 4 + 1
    assert done.rope_modules == ("transformers.models.qwen3_moe.modeling_qwen3_moe",)
    assert modeling.apply_rotary_pos_emb.__wrapped__ is original
    assert layers_impl.install(tiny_qwen3).rope_modules == done.rope_modules   # idempotent: one wrapper
    assert modeling.apply_rotary_pos_emb.__wrapped__ is original
    layers_impl.uninstall(tiny_qwen3)
    assert modeling.apply_rotary_pos_emb is original
    assert not any("forward" in vars(m) for m in tiny_qwen3.modules())


def test_whole_model_through_the_kernels(tiny_qwen3):
    """A real Qwen3-MoE forward with the kernels in place (interpreter): RoPE alone changes no bit, the
    norms stay within bf16 rounding of transformers' own."""
    from dwdp_worker.model import layers_impl

    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(3))
    want = _logits(tiny_qwen3, ids)
    layers_impl.install(tiny_qwen3, norms=False)
    assert torch.equal(_logits(tiny_qwen3, ids), want)
    layers_impl.uninstall(tiny_qwen3)
    layers_impl.install(tiny_qwen3)
    got = _logits(tiny_qwen3, ids)
    assert (got - want).abs().max() <= 5e-2 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cpu_without_interpreter_takes_transformers_forward(tiny_qwen3, monkeypatch):
    """Outside the interpreter a CPU tensor reaching an installed forward runs transformers' own, bitwise."""
    from dwdp_worker.model import layers_impl

    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    want = _logits(tiny_qwen3, ids)
    layers_impl.install(tiny_qwen3)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(_logits(tiny_qwen3, ids), want)
