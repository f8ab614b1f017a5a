"""GPU twin of ``test_dep_vs_dwdp.py`` (``pytest -m gpu``; needs >= 2 GPUs: nvidia-h200-x2/x4/x8).

d = every visible GPU up to 4, one rank per GPU: DEP over NCCL (``NCCL_NVLS_ENABLE=0``), DWDP on the
cuda backend (posix_fd handles, copy-engine peer copies). The reference runs in this process on the
rank's GPU with the same kernels.
* float32, one matmul per expert: DWDP == reference bitwise (same ops, same shapes, same device
  kind); DEP within 1e-4 (different batches per expert, partial sums per rank, atomics in index_add_).
* bf16 with ``grouped_mm``: both within bf16 tolerance of the reference.
"""

import pytest
import torch

from bench.moe_ranks import correctness_program
from bench.moe_stack import StackConfig, make_inputs, reference_forward

from ..runtime.group import free_port, run_group

pytestmark = pytest.mark.gpu
CFG = dict(layers=3, hidden=256, heads=4, experts=16, topk=4, inter=128, seed=5)


def _world():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, {n} visible")
    return min(n, 4)


@pytest.mark.parametrize("dtype_name,impl", [("float32", "loop"), ("bfloat16", "grouped_mm")])
def test_dep_and_dwdp_match_the_reference_on_gpus(dtype_name, impl):
    world = _world()
    seqlens = [[64 + 37 * r, 5] for r in range(world)]
    res = run_group(correctness_program, world, harness_timeout_s=300, store_port=free_port(), cfg_kw=CFG,
                    seqlens=seqlens, steps=2, dtype_name=dtype_name, backend="cuda", impl=impl)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    cfg, dtype = StackConfig(**CFG), getattr(torch, dtype_name)
    for r in range(world):
        got = res[r][1]
        assert got["device"] == f"cuda:{r}" and got["impl"] == impl
        assert got["dwdp_stats"]["prefetch_bytes"] > 0 and got["dep_stats"]["rows_sent_remote"] > 0
        for step in range(2):
            x = make_inputs(cfg, seqlens[r], rank=r, step=step, device=f"cuda:{r}", dtype=dtype)
            ref = reference_forward(cfg, x, seqlens[r], impl=impl, device=f"cuda:{r}", dtype=dtype).float().cpu()
            dwdp, dep = (torch.from_numpy(got[m][step]) for m in ("dwdp", "dep"))
            if dtype == torch.float32:
                assert torch.equal(dwdp, ref), f"rank {r} step {step}: max |diff| {(dwdp - ref).abs().max():.3g}"
                torch.testing.assert_close(dep, ref, rtol=1e-4, atol=1e-4)
            else:
                torch.testing.assert_close(dwdp, ref, rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(dep, ref, rtol=5e-2, atol=5e-2)
