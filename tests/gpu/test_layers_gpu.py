"""The fused non-expert layers on a real GPU (compiled): RMSNorm vs `transformers`, RoPE bitwise, whole models.

* ``rms_norm`` at prefill shapes ([16K, 2048] hidden rows, the [16K, heads, 128] q/k views, DeepSeek-V3's
  7168/1536/512 rows) vs `transformers`' own module on the GPU: max |Δ| and the share of bitwise elements
  printed, at most one rounding step apart asserted; batch invariance (a row alone = the row in 16K rows);
* ``apply_rope`` bitwise `transformers`' ``apply_rotary_pos_emb`` on the GPU (Qwen3 GQA views, MLA rope part);
* whole models of the three architectures on DWDP's experts: installing RoPE changes no logit bit, the
  norms stay within bf16 rounding (max |Δlogit| printed); alone-vs-packed equality is printed (whole-model
  batch invariance also depends on cuBLAS: test_kernels_gpu.py::test_model_batch_invariance names the first
  module that breaks it, now with these layers in place).
Run: ``pytest -m gpu tests/gpu/test_layers_gpu.py -s``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                 reason="TRITON_INTERPRET is set: these tests compile for the GPU")]

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


def _norm(d, device, dtype=torch.bfloat16, seed=0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    mod = Qwen3MoeRMSNorm(d, eps=1e-6).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.5 * torch.randn(d, generator=gen, device=device))
    return mod


@pytest.mark.parametrize("shape", [(16384, 2048), (16384, 16, 128), (4096, 7168), (4096, 1536), (4096, 512)])
def test_rms_norm_against_transformers_on_gpu(shape, cuda_device):
    from dwdp_runtime.kernels.rmsnorm import rms_norm

    mod = _norm(shape[-1], cuda_device)
    gen = torch.Generator(device=cuda_device).manual_seed(1)
    x = (3 * torch.randn(*shape, generator=gen, device=cuda_device)).bfloat16()
    with torch.no_grad():
        want = mod(x)
        got = rms_norm(x, mod.weight, mod.variance_epsilon)
    diff = (got.float() - want.float()).abs()
    same = (got == want).float().mean().item()
    print(f"{shape}: max|ours - transformers| {diff.max().item():.3g} (max|ref| {want.float().abs().max().item():.3g}),"
          f" bitwise {same:.4%}")
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bool((diff <= want.float().abs() * 2.0 ** -6 + 1e-30).all())  # y and out: two roundings
    assert same >= 0.99


def test_rms_norm_batch_invariant_on_gpu(cuda_device):
    from dwdp_runtime.kernels.rmsnorm import rms_norm

    mod = _norm(2048, cuda_device)
    x = torch.randn(16384, 2048, generator=torch.Generator(device=cuda_device).manual_seed(2),
                    device=cuda_device).bfloat16()
    packed = rms_norm(x, mod.weight, 1e-6)
    for i in (0, 5000, 16383):
        assert torch.equal(rms_norm(x[i:i + 1].clone(), mod.weight, 1e-6)[0], packed[i])


@pytest.mark.parametrize("heads,kv_heads,d,cos_batch", [(16, 8, 128, None), (16, 1, 64, 1), (32, 4, 128, None)])
def test_rope_bitwise_on_gpu(heads, kv_heads, d, cos_batch, cuda_device):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    from dwdp_runtime.kernels.rope import apply_rope, supports

    b, length = (2, 4096) if cos_batch else (1, 16384)
    gen = torch.Generator(device=cuda_device).manual_seed(3)
    q = torch.randn(b, length, heads, d, generator=gen, device=cuda_device).bfloat16().transpose(1, 2)
    k = torch.randn(b, length, kv_heads, d, generator=gen, device=cuda_device).bfloat16().transpose(1, 2)
    ang = torch.arange(length, device=cuda_device, dtype=torch.float32)[:, None] * \
        (1.0 / 10000 ** (torch.arange(0, d, 2, device=cuda_device, dtype=torch.float32) / d))[None, :]
    ang = torch.cat([ang, ang], dim=-1)[None].expand(cos_batch or b, -1, -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    assert supports(q, k, cos, sin, 1)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = apply_rope(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("layers-gpu")
    return {a: write_synthetic(a, base / a, seed=5, hidden_size=512, num_layers=3, num_experts=16,
                               moe_intermediate_size=256, dtype="bfloat16", top_k=4) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_model_fused_layers_on_gpu(arch, bf16_models, cuda_device):
    from dwdp_worker.model import layers_impl
    from dwdp_worker.launch.oracle import Reference

    ref = Reference(bf16_models[arch], device=cuda_device, experts="auto")   # experts + fused layers (engine's)
    done = layers_impl.install(ref.model)
    assert done.norms > 0
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, ref.model.config.vocab_size, (n,), generator=gen).tolist() for n in (700, 33, 1500)]
    try:
        fused = ref.logits(seqs)
        layers_impl.uninstall(ref.model)
        layers_impl.install(ref.model, rope=False)
        norms_only = ref.logits(seqs)
        layers_impl.uninstall(ref.model)
        plain = ref.logits(seqs)
        alone = []
        layers_impl.install(ref.model)
        alone = [ref.logits([s])[0] for s in seqs]
    finally:
        layers_impl.uninstall(ref.model)
    diff = (fused - plain).abs().max().item()
    print(f"{arch}: rope modules {done.rope_modules}, {done.norms} norms; max|dlogit| fused vs transformers' "
          f"layers {diff:.3g} (max|logit| {plain.abs().max().item():.3g}); RoPE swap bitwise "
          f"{torch.equal(fused, norms_only)}; packed == alone {[torch.equal(a, f) for a, f in zip(alone, fused)]}")
    assert torch.equal(fused, norms_only)          # the RoPE kernel changes no bit (or is not installed)
    assert diff <= 5e-2 * plain.abs().max().item()
