"""The fused router on a real GPU (compiled): against `transformers`' routers at real shapes, its counts, no host sync.

* Qwen3-30B (128 experts, top-8, bf16 logits) and DeepSeek-V3 (256 experts, 8 groups keep 4, top-8, fp32 logits)
  at 4K tokens: the same experts as `transformers` (exact ties aside: bf16 logits), weights within
  ``WEIGHT_RTOL`` (fp32) / one bf16 step;
* the chunk counts it writes give the alignment's own routing plan, bitwise;
* ``moe_block`` (gate GEMM + fused router + experts) captures into a CUDA graph — a host sync anywhere in it
  would fail the capture — and the replay gives the eager bits;
* a token's routing alone = inside 4K tokens (batch invariance of the router).
Run: ``pytest -m gpu tests/gpu/test_router_gpu.py -s``.
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

TOKENS = 4096


def _routers(device):
    from bench.moe_block import SHAPES, router_module
    from bench.moe_kernels import BlockShape

    q_shape, q_rs = SHAPES["qwen3"]
    d_shape, d_rs = SHAPES["dsv3"]
    d_shape = BlockShape("dsv3", d_shape.hidden, d_shape.inter, 256, d_shape.top_k)
    return {"qwen3": (q_shape, router_module(q_shape, q_rs, device)),
            "dsv3": (d_shape, router_module(d_shape, d_rs, device))}


@pytest.mark.parametrize("name", ["qwen3", "dsv3"])
def test_fused_router_matches_transformers_at_real_shapes(name, cuda_device):
    from tests.kernels.test_router import _bf16_step, _same_picks

    from dwdp_runtime.kernels import router, routing

    shape, gate = _routers(cuda_device)[name]
    x = torch.randn(TOKENS, shape.hidden, device=cuda_device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=cuda_device).manual_seed(3))
    bias = getattr(gate, "e_score_correction_bias", None)
    with torch.inference_mode():
        logits, want_w, want_ids = gate(x)
        spec = router.of_module(gate, logits.dtype)
        got = router.route(logits, spec, bias)
    if spec.score == "softmax":
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        ties = _same_picks(got.topk_ids, want_ids, probs)
        assert ((got.topk_weights.float() - want_w.float()).abs() <= _bf16_step(want_w)).all()
        print(f"{name}: same experts as transformers ({ties} tied picks of {TOKENS * shape.top_k})")
    else:
        a, b = torch.sort(want_ids.long(), -1), torch.sort(got.topk_ids.long(), -1)
        same = (a.values == b.values).all(-1)
        print(f"{name}: same expert set for {int(same.sum())}/{TOKENS} tokens")
        # a different set needs a near-tie within the ulps our sigmoid / sums may differ by: allowed at 0.1 %
        assert int((~same).sum()) <= TOKENS // 1000
        assert torch.allclose(torch.gather(got.topk_weights, 1, b.indices)[same],
                              torch.gather(want_w, 1, a.indices)[same], rtol=router.WEIGHT_RTOL, atol=0)
    plan_a = routing.align_routing(got.topk_ids, shape.experts, 64, counts=got.counts)
    plan_b = routing.align_routing(got.topk_ids, shape.experts, 64)
    n = int(plan_b.num_padded)
    assert got.counts is not None and int(plan_a.num_padded) == n
    assert torch.equal(plan_a.sorted_pairs[:n], plan_b.sorted_pairs[:n])
    assert torch.equal(plan_a.block_expert, plan_b.block_expert) and torch.equal(plan_a.row_of_pair, plan_b.row_of_pair)
    one = router.route(logits[1234:1235].contiguous(), spec, bias)
    assert torch.equal(one.topk_ids, got.topk_ids[1234:1235]) and torch.equal(one.topk_weights, got.topk_weights[1234:1235])


def test_moe_block_has_no_host_sync_and_replays_bitwise(cuda_device):
    from bench.moe_block import SHAPES
    from bench.moe_kernels import experts_module

    from dwdp_runtime.kernels import router
    from dwdp_runtime.kernels.moe import moe_block
    from dwdp_worker.model import experts_impl

    shape, _ = SHAPES["qwen3"]
    gate = _routers(cuda_device)["qwen3"][1]
    mod = experts_module(shape, cuda_device)
    layout = experts_impl.layout_of(mod)
    weights = experts_impl.weights_of(mod, layout)
    spec = router.of_module(gate, torch.bfloat16)
    x = torch.randn(TOKENS, shape.hidden, device=cuda_device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=cuda_device).manual_seed(4))
    with torch.inference_mode():
        eager = moe_block(x, gate.weight, spec, weights, layout)  # compiles every kernel first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe_block(x, gate.weight, spec, weights, layout)
        graph.replay()
        torch.cuda.synchronize()
        _, w, ids = gate(x)
        reference = experts_impl.dwdp_experts_forward(mod, x, ids, w)
    assert torch.equal(captured, eager)
    assert (eager.float() - reference.float()).abs().max().item() <= 0.02 * reference.float().abs().max().item()
