"""``--batch-invariant`` on a real GPU: bitwise alone vs packed, for the GEMM and for whole models.

* ``bi_matmul`` at the dense shapes of Qwen3-30B and DeepSeek-V3 (M up to 16K): a row alone (M = 1), inside a
  small batch and inside a 16K batch give the same bits — the hardware half of the invariant (an MMA computes an
  element the same way wherever the element sits in its tile), which the CPU interpreter cannot show;
* whole tiny random models (qwen3_moe, mixtral, deepseek_v3; our experts and fused layers, as the engine runs
  them) with the mode on: a sequence's logits alone = the same sequence packed with 20 others, bitwise. Any
  divergence fails, and the message names the first module whose output rows differ (cuBLAS, SDPA, …).
Run: ``pytest -m gpu tests/gpu/test_batch_invariant_gpu.py -s``.
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

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
#: (K, N) of dense GEMMs that matter: Qwen3-30B qkv / o / router, DeepSeek-V3 q_b / o / fp32-router width
GEMMS = ((2048, 5120), (4096, 2048), (2048, 128), (1536, 24576), (16384, 7168))


@pytest.mark.parametrize("k,n", GEMMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bi_matmul_rows_are_bitwise_alone_small_and_large_batches(k, n, dtype, cuda_device):
    from dwdp_runtime.kernels import bi_matmul

    if dtype == torch.float32 and n > 2048:
        pytest.skip("fp32 only feeds routers (narrow N)")
    gen = torch.Generator(device=cuda_device).manual_seed(k + n)
    x = torch.randn(16384, k, generator=gen, device=cuda_device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=cuda_device) * k ** -0.5).to(dtype)
    full = bi_matmul.matmul(x, w.t())
    for start, m in ((0, 1), (9001, 1), (130, 37), (4000, 4096)):
        part = bi_matmul.matmul(x[start:start + m].contiguous(), w.t())
        assert torch.equal(part, full[start:start + m]), (start, m)
    ref = torch.nn.functional.linear(x[:256].double(), w.double())
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((full[:256].double() - ref).abs() <= tol * ref.abs() + 1e-3).all()


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("bi-gpu-ckpt")
    return {a: write_synthetic(a, base / a, seed=21, hidden_size=512, num_layers=4, num_experts=16,
                               moe_intermediate_size=256, dtype="bfloat16", top_k=4, vocab_size=2048,
                               num_heads=4) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_model_logits_bitwise_alone_vs_packed_with_batch_invariant(arch, bf16_models, cuda_device):
    from tests.gpu.test_kernels_gpu import _first_divergence, _prompts

    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model.packing import pack

    ref = Reference(bf16_models[arch], device=cuda_device, experts="dwdp", batch_invariant=True)
    try:
        prompts = _prompts(21, 2048, seed=100 + ARCHS.index(arch))
        mode = ref.attachment.batch_invariant
        before = sum(mode.calls.values())
        alone = ref.logits([prompts[7]])
        packed = ref.logits(prompts)
        assert sum(mode.calls.values()) > before  # the forwards really ran our GEMM
        if torch.equal(alone[0], packed[7]):
            print(f"{arch}: batch invariant with --batch-invariant (bitwise), GEMM calls {mode.calls}")
            return
        ids1, pos1, _ = pack([prompts[7]], cuda_device)
        ids2, pos2, _ = pack(prompts, cuda_device)
        start = sum(len(p) for p in prompts[:7])
        where = _first_divergence(ref.model, ids1, pos1, ids2, pos2, list(range(start, start + len(prompts[7]))))
        pytest.fail(f"{arch}: NOT batch invariant with --batch-invariant: logits differ by "
                    f"{(alone[0] - packed[7]).abs().max().item():.3g}; first module whose rows differ: {where}")
    finally:
        ref.attachment.close()


def test_the_mode_is_gone_after_the_attachment_closes(bf16_models, cuda_device):
    """The attachment owns the registration: after ``close`` cuBLAS computes ``mm`` again."""
    from dwdp_runtime.kernels import batch_invariant

    from dwdp_worker.launch.oracle import Reference

    ref = Reference(bf16_models["qwen3_moe"], device=cuda_device, experts="dwdp", batch_invariant=True)
    assert batch_invariant.active("cuda")
    ref.attachment.close()
    assert not batch_invariant.active("cuda")
