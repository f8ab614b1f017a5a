"""The ``"dwdp"`` experts implementation inside real `transformers` models (Triton interpreter on CPU).

* selected explicitly, all three architectures give logits within bf16 rounding of `transformers`' own
  grouped_mm experts on the same weights (router, group-limited routing and shared experts untouched);
* ``auto`` on CPU keeps `transformers`' default, bitwise (the CPU engine must equal the oracle);
* modules the kernels do not cover fall back to grouped_mm, bitwise.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], list(range(40, 75)), [7]]


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("kernels-ckpt")
    return {a: write_synthetic(a, base / a, seed=3, hidden_size=64, num_layers=2, num_experts=6,
                               moe_intermediate_size=48, dtype="bfloat16", top_k=2) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_dwdp_experts_match_transformers(arch, bf16_checkpoints):
    from dwdp_worker.launch.oracle import Reference

    plain = Reference(bf16_checkpoints[arch])
    assert plain.model.config._experts_implementation == "grouped_mm"
    want = plain.logits(PROMPTS)
    ours = Reference(bf16_checkpoints[arch], experts="dwdp")
    assert ours.model.config._experts_implementation == "dwdp"
    from dwdp_worker.model import experts_impl, registry as models

    for e in models.model_layout(ours.model):  # the kernels read the discovered layout, set by attach
        module = ours.model.get_submodule(e.path)
        assert module._dwdp_kernels == experts_impl.kernel_layout(e, "silu")
    got = ours.logits(PROMPTS)
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert 0 < diff <= 2e-2 * scale, (diff, scale)   # the kernels ran (not bitwise) and agree to bf16 rounding
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff   # top-1 must agree wherever rounding cannot flip it
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_auto_on_cpu_keeps_transformers_bitwise(bf16_checkpoints):
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model.attach import attach

    ref = Reference(bf16_checkpoints["qwen3_moe"])
    want = ref.logits(PROMPTS)
    assert attach(ref.model, device="cpu", experts="auto").experts == "grouped_mm"
    assert torch.equal(ref.logits(PROMPTS), want)


def test_gpt_oss_bf16_runs_the_kernels_with_its_clamped_gate(tmp_path):
    """gpt-oss's clamped SwiGLU (interleaved rows, biases) is found from its ``_apply_gate`` and fused: the ``dwdp``
    forward runs the kernels (no grouped_mm fallback) and the logits agree with `transformers`' to bf16 rounding."""
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model import experts_impl
    from dwdp_worker.model.registry import experts_sites

    ckpt = write_synthetic("gpt_oss", tmp_path / "gpt_oss", seed=3, dtype="bfloat16",
                           config_overrides=dict(hidden_size=64, intermediate_size=64, head_dim=16))
    want = Reference(ckpt).logits(PROMPTS)
    ours = Reference(ckpt, experts="dwdp")
    module = experts_sites(ours.model)[0].module
    assert experts_impl.unsupported_reason(module, torch.zeros(1, 64, dtype=torch.bfloat16)) is None
    assert experts_impl.clamped_glu(module).up_shift == 1.0
    got = ours.logits(PROMPTS)
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert 0 < diff <= 2e-2 * scale, (diff, scale)   # the kernels ran (not bitwise) and agree to bf16 rounding


def test_uncovered_module_falls_back_bitwise(bf16_checkpoints):
    """A custom ``_apply_gate`` (e.g. GPT-OSS's clamped gate) is not what the epilogue computes: fall back."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from dwdp_worker.model import experts_impl
    from dwdp_worker.model.registry import experts_sites
    from dwdp_worker.launch.oracle import Reference

    module = experts_sites(Reference(bf16_checkpoints["mixtral"]).model)[0].module
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w, ids = torch.topk(torch.rand(9, 6, generator=gen).softmax(-1), 2, dim=-1)
    assert experts_impl.unsupported_reason(module, x) is None

    class ClampedGate(type(module)):
        def _apply_gate(self, h):
            g, u = h.chunk(2, dim=-1)
            return self.act_fn(g.clamp(max=7.0)) * u

    module.__class__ = ClampedGate
    assert "custom gate" in experts_impl.unsupported_reason(module, x)
    assert torch.equal(experts_impl.dwdp_experts_forward(module, x, ids, w),
                       grouped_mm_experts_forward(module, x, ids, w))


def test_unknown_choice_is_refused(bf16_checkpoints):
    from dwdp_worker.model import experts_impl
    from dwdp_worker.launch.oracle import Reference

    with pytest.raises(ValueError, match="not one of"):
        experts_impl.choose(Reference(bf16_checkpoints["qwen3_moe"]).model, "cpu", "fastest")


def test_kernels_package_imports_without_triton(tmp_path):
    """``import dwdp_runtime.kernels`` (and the worker's experts_impl) must work where triton is absent."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import importlib.util as u; u.find_spec = (lambda f: (lambda n, *a: None if n == 'triton' else f(n, *a)))"
            "(u.find_spec)\n"
            "import dwdp_runtime.kernels as k, dwdp_runtime.kernels.tuning as t, dwdp_worker.model.experts_impl\n"
            "assert not k.available('cuda') and not k.available('cpu')\n"
            "print(t.default_config(t.ShapeKey('gate_up', 768, 2048, 128, 8, 'bfloat16', 1024)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "GemmConfig(block_m=128" in out.stdout


def test_engine_runs_the_kernels_over_dwdp_composites(bf16_checkpoints):
    """A 2-rank DWDP engine on ``experts="dwdp"`` (host backend: the kernels read the composite views the
    hooks bind, pointer + strides) equals the unsharded model on the same kernels, bitwise."""
    from tests.kernels.programs import dwdp_engine_program
    from tests.runtime.group import run_group

    from dwdp_worker.launch.oracle import Reference

    path = str(bf16_checkpoints["qwen3_moe"])
    res = run_group(dwdp_engine_program, 2, model_dir=path,
                    batches=[PROMPTS], experts="dwdp", harness_timeout_s=240)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    torch.set_num_threads(1)
    want = Reference(path, experts="dwdp").logits(PROMPTS)
    for rank, (_, value) in res.items():
        assert value["impl"] == "dwdp"
        assert torch.equal(torch.from_numpy(value["logits"][0]), want), rank

