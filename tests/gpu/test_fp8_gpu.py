"""FP8 block-scaled experts on CUDA: the kernels' hardware fp8 path and the sharded engine (``pytest -m gpu``).

  * the GPU's own e4m3 conversion and MMA: activation quantization bitwise equal to torch's, the whole FP8
    block equal to the torch block math (``tests/kernels/fp8_reference.py``) within fp32 summation order;
  * an FP8 checkpoint of every architecture served by a d = 2 group (CUDA backend, ranks as processes) equals
    the same model unsharded with the same FP8 kernels (``fp8_checkpoint.bind_fp8_experts`` on the dequantized
    bf16 twin): DWDP moves the e4m3 weights and their scales, never changes the math.
Measured on H200 (2026-12-01, bench/fp8_prefill.py): sharded vs unsharded FP8 logits bitwise equal.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 250)), [200]], [list(range(0, 256)) * 4]]


def test_fp8_kernels_on_gpu_match_block_math():
    from dwdp_runtime.kernels import fp8_moe
    from dwdp_runtime.kernels.fp8_quant import quantize_groups, quantize_groups_reference

    from tests.kernels.fp8_reference import fp8_moe_reference, small_fp8_block_case

    x, ids, w, w1, s1, w2, s2 = small_fp8_block_case()
    q, s = quantize_groups(x.cuda())
    qr, sr = quantize_groups_reference(x)
    assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    got = fp8_moe.triton_fp8_moe_forward(*(a.cuda() for a in (x, ids, w, w1, s1, w2, s2))).cpu()
    want = fp8_moe_reference(x, ids, w, w1, s1, w2, s2)
    assert float((got.float() - want.float()).abs().max()) <= 2 ** -6 * float(want.abs().max())


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    from dwdp_worker.checkpoint.fp8 import dequantize_checkpoint
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("gpu-fp8")
    out = {}
    for a in ARCHS:
        fp8 = write_synthetic(a, base / a, seed=5, hidden_size=256, moe_intermediate_size=256, num_layers=4,
                              dtype="bfloat16", quant="fp8")
        out[a] = (fp8, dequantize_checkpoint(fp8, base / f"{a}-ref", dtype="bfloat16"))
    return out


def test_gpu_fp8_sharded_equals_unsharded_fp8(fp8_checkpoints):
    from tests.worker.oracle_group import run_oracle_group

    from dwdp_worker.checkpoint.fp8 import bind_fp8_experts
    from dwdp_worker.launch.oracle import Reference

    runs = [(f"{a}-fp8", str(fp8_checkpoints[a][0]), 5, 3, None) for a in ARCHS]
    res = run_oracle_group(2, runs, BATCHES, backend="auto", gpus=torch.cuda.device_count(), harness_timeout_s=600)
    for a in ARCHS:
        fp8, ref_dir = fp8_checkpoints[a]
        ref = Reference(ref_dir, dtype="bfloat16", device="cuda:0", experts="auto")
        bind_fp8_experts(ref.model, fp8, "cuda:0", torch.bfloat16)
        want = [ref.logits(b) for b in BATCHES]
        del ref
        for rank, value in res.items():
            got = value[f"{a}-fp8"]
            assert got["stats"].backend != "host"
            for n, (g, w) in enumerate(zip(got["logits"], want)):
                g = torch.from_numpy(g)
                print(f"{a} fp8 rank {rank} forward {n}: max|diff| {(g - w).abs().max().item():.3g} "
                      f"(bitwise={torch.equal(g, w)})")
                torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-2 * max(w.abs().max().item(), 1.0))
        torch.cuda.empty_cache()
