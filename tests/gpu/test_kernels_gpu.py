"""DWDP's Triton MoE kernels on a real GPU (compiled, not interpreted): correctness and batch invariance.

* every weight layout (fused/interleaved/no gate, transposed, bias) against a float64 loop;
* the Qwen3-MoE block shape against `transformers`' grouped_mm experts: max |Δ| and relative error;
* a token's experts output is bitwise the same alone and packed into batches of other load buckets
  (other row-block tilings);
* whole models (Qwen3-MoE, Mixtral, DeepSeek-V3): ``experts="dwdp"`` vs plain `transformers`, max |Δ|
  and top-1 agreement over 1,000 random prompts;
* model-level batch invariance: a sequence's logits alone vs packed with others, on our experts; on a
  mismatch the message names the first module whose output rows differ.
Run: ``pytest -m gpu tests/gpu/test_kernels_gpu.py -s`` (prints the measured figures).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                 reason="TRITON_INTERPRET is set: these tests compile for the GPU")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tests.kernels.reference import experts_ref, rel_err  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


def _weights(experts, hidden, inter, *, has_gate=True, transposed=False, bias=False, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    n1 = 2 * inter if has_gate else inter
    gu = (torch.randn(experts, n1, hidden, generator=gen, device=device) * hidden ** -0.5).bfloat16()
    dn = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter ** -0.5).bfloat16()
    if transposed:
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    b1 = (0.1 * torch.randn(experts, n1, generator=gen, device=device)).bfloat16() if bias else None
    b2 = (0.1 * torch.randn(experts, hidden, generator=gen, device=device)).bfloat16() if bias else None
    return gu, dn, b1, b2


def _routed(tokens, hidden, experts, top_k, seed=1, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    w, ids = torch.topk(torch.randn(tokens, experts, generator=gen, device=device).softmax(-1), top_k, dim=-1)
    return x, ids, w


@pytest.mark.parametrize("layout", ["concatenated", "interleaved", "transposed", "no_gate", "bias"])
def test_layouts_against_float64(layout, cuda_device):
    from dwdp_runtime.kernels import ExpertsLayout, ExpertWeights, fused_experts

    lay = ExpertsLayout(has_gate=layout != "no_gate", is_transposed=layout == "transposed",
                        is_concatenated=layout != "interleaved", has_bias=layout == "bias")
    gu, dn, b1, b2 = _weights(8, 256, 192, has_gate=lay.has_gate, transposed=lay.is_transposed, bias=lay.has_bias)
    x, ids, w = _routed(300, 256, 8, 2)
    got = fused_experts(x, ids, w, ExpertWeights(gu, dn, b1, b2), lay).cpu()
    want = experts_ref(x.cpu(), ids.cpu(), w.cpu(), gu.cpu(), dn.cpu(), has_gate=lay.has_gate,
                       transposed=lay.is_transposed, concatenated=lay.is_concatenated,
                       gate_up_bias=None if b1 is None else b1.cpu(), down_bias=None if b2 is None else b2.cpu())
    err = rel_err(got, want)
    print(f"{layout}: rel err vs float64 {err:.2e}")
    assert err < 8e-3


@pytest.mark.parametrize("tokens", [1024, 4096])
def test_qwen3_block_shape_against_transformers(tokens, cuda_device):
    from bench.moe_kernels import SHAPES, experts_module, routed_inputs

    from dwdp_worker.model import experts_impl

    shape = SHAPES["qwen3"]
    mod = experts_module(shape, cuda_device)
    x, ids, w = routed_inputs(shape, tokens, cuda_device)
    with torch.inference_mode():
        theirs = mod(x, ids, w).float()
        ours = experts_impl.dwdp_experts_forward(mod, x, ids, w).float()
        # float32 truth on the same bf16 weights (the loop over experts is cheap at this size)
        truth = torch.zeros_like(theirs)
        for e in range(shape.experts):
            t, j = (ids == e).nonzero(as_tuple=True)
            if t.numel():
                h = x[t].float() @ mod.gate_up_proj[e].float().T
                a = torch.nn.functional.silu(h[:, :shape.inter]) * h[:, shape.inter:]
                truth.index_add_(0, t, (a @ mod.down_proj[e].float().T) * w[t, j, None].float())
    diff = (ours - theirs).abs().max().item()
    e_ours, e_theirs = rel_err(ours.cpu(), truth.cpu().double()), rel_err(theirs.cpu(), truth.cpu().double())
    print(f"T={tokens}: max|ours - transformers| {diff:.3g} (max|ref| {theirs.abs().max().item():.3g}); "
          f"rel err vs fp32: ours {e_ours:.2e}, transformers {e_theirs:.2e}")
    assert e_ours <= 1.5 * e_theirs + 1e-3


def test_experts_batch_invariance(cuda_device):
    """Rows of 8 tokens alone (16-row blocks) vs inside batches of 640 and 8192 tokens (64/128-row blocks)."""
    from dwdp_runtime.kernels import ExpertWeights, fused_experts, tuning

    gu, dn, _, _ = _weights(64, 1024, 512)
    x, ids, w = _routed(8192, 1024, 64, 8)
    weights = ExpertWeights(gu, dn)
    blocks = {n: tuning.default_config(tuning.ShapeKey("gate_up", 512, 1024, 64, 8, "bfloat16",
                                                       tuning.load_bucket(n, 8, 64))).block_m
              for n in (8, 640, 8192)}
    assert len(set(blocks.values())) == 3, blocks
    alone = fused_experts(x[:8], ids[:8], w[:8], weights)
    for n in (640, 8192):
        packed = fused_experts(x[:n], ids[:n], w[:n], weights)
        assert torch.equal(alone, packed[:8]), f"T={n} (BLOCK_M {blocks[n]}) vs alone (BLOCK_M {blocks[8]})"


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("kernels-gpu-ckpt")
    return {a: write_synthetic(a, base / a, seed=21, hidden_size=512, num_layers=4, num_experts=16,
                               moe_intermediate_size=256, dtype="bfloat16", top_k=4, vocab_size=2048,
                               num_heads=4) for a in ARCHS}


def _prompts(n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 96, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n_,), generator=gen).tolist() for n_ in lens]


@pytest.mark.parametrize("arch", ARCHS)
def test_model_agreement_on_random_prompts(arch, bf16_models, cuda_device):
    """1,000 random prompts: ours vs `transformers` (both bf16) and both vs a float32 model (eager experts).

    Tiny random models amplify bf16 rounding (a flipped expert choice moves a logit by O(1)), so ours vs
    `transformers` alone cannot show which one is off; the float32 model can: ours must agree with it at
    least as well as `transformers`' own bf16 experts do (top-1 within 1 %, mean |Δlogit| within 25 %)."""
    from dwdp_worker.launch.oracle import Reference

    n = 1000
    prompts = _prompts(n, 2048, seed=ARCHS.index(arch))
    plain = Reference(bf16_models[arch], device=cuda_device)
    ours = Reference(bf16_models[arch], device=cuda_device, experts="dwdp")
    truth = Reference(bf16_models[arch], device=cuda_device, dtype="float32", experts="eager")
    assert ours.model.config._experts_implementation == "dwdp"
    agree = dict(ours_tf=0, ours_fp32=0, tf_fp32=0)
    max_diff, abs_ours, abs_tf = 0.0, 0.0, 0.0
    for i in range(0, n, 50):
        batch = prompts[i:i + 50]
        want, got, exact = plain.logits(batch), ours.logits(batch), truth.logits(batch)
        top = {k: v.argmax(-1) for k, v in (("tf", want), ("ours", got), ("fp32", exact))}
        agree["ours_tf"] += int((top["ours"] == top["tf"]).sum())
        agree["ours_fp32"] += int((top["ours"] == top["fp32"]).sum())
        agree["tf_fp32"] += int((top["tf"] == top["fp32"]).sum())
        max_diff = max(max_diff, (got - want).abs().max().item())
        abs_ours += (got - exact).abs().mean().item() / (n / 50)
        abs_tf += (want - exact).abs().mean().item() / (n / 50)
    print(f"{arch}: top-1 agreement ours/transformers {agree['ours_tf']}/{n}, max|Δlogit| {max_diff:.3g}; "
          f"vs float32: top-1 ours {agree['ours_fp32']}/{n}, transformers {agree['tf_fp32']}/{n}; "
          f"mean|Δlogit| ours {abs_ours:.3g}, transformers {abs_tf:.3g}")
    assert agree["ours_fp32"] >= agree["tf_fp32"] - 0.01 * n
    assert abs_ours <= 1.25 * abs_tf + 1e-3


def _first_divergence(model, alone_ids, alone_pos, packed_ids, packed_pos, rows):
    """(module name, max|Δ|) of the first module whose output rows differ alone vs packed, or None."""
    outs: dict[str, list] = {}
    hooks = []
    for name, mod in model.named_modules():
        def hook(m, a, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(t) and t.dim() >= 2:
                outs.setdefault(name, []).append(t.reshape(-1, t.shape[-1]).detach().clone())
        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=alone_ids, position_ids=alone_pos, use_cache=False)
            model(input_ids=packed_ids, position_ids=packed_pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for name, pair in outs.items():  # registration order = forward order for these models
        if len(pair) == 2 and pair[0].shape[0] == len(rows) and pair[1].shape[0] > rows[-1]:
            a, b = pair[0], pair[1][rows]
            if not torch.equal(a, b):
                return name, (a.float() - b.float()).abs().max().item()
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_model_batch_invariance(arch, bf16_models, cuda_device):
    """A sequence's logits alone vs packed with 20 others, on our experts.

    Our kernels are batch invariant by construction (``test_experts_batch_invariance``); the rest of the
    model is `transformers` + cuBLAS, whose dense GEMMs may pick another kernel for another row count. So:
    bitwise equal logits pass; otherwise the first module whose output rows differ must not be an experts
    module (the message names it: the op that breaks invariance, and it is not ours)."""
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model.packing import pack

    ref = Reference(bf16_models[arch], device=cuda_device, experts="dwdp")
    prompts = _prompts(21, 2048, seed=100 + ARCHS.index(arch))
    alone = ref.logits([prompts[7]])
    packed = ref.logits(prompts)
    if torch.equal(alone[0], packed[7]):
        print(f"{arch}: batch invariant (bitwise)")
        return
    ids1, pos1, _ = pack([prompts[7]], cuda_device)
    ids2, pos2, _ = pack(prompts, cuda_device)
    start = sum(len(p) for p in prompts[:7])
    where = _first_divergence(ref.model, ids1, pos1, ids2, pos2, list(range(start, start + len(prompts[7]))))
    print(f"{arch}: NOT batch invariant: logits differ by {(alone[0] - packed[7]).abs().max().item():.3g}; "
          f"first module whose rows differ: {where}")
    assert where is not None, "logits differ but no module output does"
    assert not where[0].endswith(".experts"), f"our experts kernels broke batch invariance: {where}"


def test_tma_weight_tiles_equal_pointer_loads_on_gpu(cuda_device):
    """Weight tiles through TMA descriptors give bitwise the pointer-load result (Qwen3 block, 4K tokens):
    switching the load path between load buckets cannot break batch invariance."""
    from bench.moe_kernels import SHAPES, experts_module, routed_inputs

    from dwdp_runtime.kernels import fused_experts, moe, tuning
    from dwdp_worker.model import experts_impl

    shape = SHAPES["qwen3"]
    mod = experts_module(shape, cuda_device)
    x, ids, w = routed_inputs(shape, 4096, cuda_device)
    layout = experts_impl.layout_of(mod)
    weights = experts_impl.weights_of(mod, layout)
    p = moe._plan(4096, shape.top_k, weights, layout, x.dtype)
    results = {}
    try:
        for tma in (False, True):
            tuning.remember(p.key1, tuning.GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=4, tma=tma))
            tuning.remember(p.key2, tuning.GemmConfig(block_m=128, block_n=256, num_warps=8, num_stages=4, tma=tma))
            results[tma] = fused_experts(x, ids, w, weights, layout)
    finally:
        tuning.forget_all()
    assert torch.equal(results[True], results[False])
