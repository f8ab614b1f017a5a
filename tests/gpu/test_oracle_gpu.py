"""GPU oracle: DWDP-sharded logits vs unsharded `transformers` on CUDA (bf16), every architecture, d = 2, 3, 4.

Both sides run the same experts forward: the engine's ``auto`` choice (DWDP's Triton kernels on CUDA),
so the unsharded reference is ``Reference(..., experts="auto")`` — DWDP must not change the math, and
the comparison isolates sharding from the choice of kernels (which tests/gpu/test_kernels_gpu.py checks).

Ranks are real processes using the CUDA backend (``backend="auto"``); with fewer GPUs than ranks several
ranks share a GPU (rank r on ``cuda:(r % num_gpus)``). Tolerance is bf16's (the kernels are the same, so
the run is usually bitwise; the test reports which). Run: ``pytest -m gpu tests/gpu/test_oracle_gpu.py -s``.
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

BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 250)), [200]], [list(range(0, 256)) * 4]]
SHARDING = {2: (5, 3), 3: (3, 3), 4: (3, 2)}
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("gpu-ckpt")
    # hidden 256: expert sizes are multiples of 64 bytes, like real models
    return {a: write_synthetic(a, base / a, seed=5, hidden_size=256, num_layers=4, dtype="bfloat16")
            for a in ARCHS}


@pytest.mark.parametrize("d", sorted(SHARDING))
def test_gpu_sharded_logits_match_unsharded(d, gpu_checkpoints):
    from tests.worker.oracle_group import run_oracle_group

    from dwdp_worker.launch.oracle import Reference

    k, s = SHARDING[d]
    runs = [(f"{a}-d{d}", str(gpu_checkpoints[a]), k, s, None) for a in ARCHS]
    res = run_oracle_group(d, runs, BATCHES, backend="auto", gpus=torch.cuda.device_count(), harness_timeout_s=600)
    for a in ARCHS:
        ref = Reference(gpu_checkpoints[a], device="cuda:0", experts="auto")
        want = [ref.logits(b) for b in BATCHES]
        del ref
        for rank, value in res.items():
            got = value[f"{a}-d{d}"]
            assert got["stats"].backend != "host"
            for i, (g, w) in enumerate(zip(got["logits"], want)):
                g = torch.from_numpy(g)
                scale = w.abs().max().item()
                diff = (g - w).abs().max().item()
                print(f"{a} d={d} rank {rank} forward {i}: max|diff| {diff:.3g} (bitwise={torch.equal(g, w)})")
                torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-2 * max(scale, 1.0))
        torch.cuda.empty_cache()
