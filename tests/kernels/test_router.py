"""The fused router (``kernels/router.py``) against `transformers`' own router modules, under the interpreter.

Contract (router's docstring): the same experts (softmax routers: the same order too), weights within
``WEIGHT_RTOL`` in fp32 and at most one bf16 step apart after a bf16 cast; the chunk counts it writes make the
same routing plan, bit for bit, as the alignment's own count kernel; a token's outputs do not depend on its batch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """One bf16 step (ulp) at each element's magnitude."""
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), torch.frexp(x.float()).exponent - 8)


def _qwen3(num_experts=128, top_k=8, hidden=64, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(seed)
    r = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                                          norm_topk_prob=True)).eval()
    with torch.no_grad():
        r.weight.normal_(0, hidden ** -0.5)
    return r.to(torch.bfloat16)


def _deepseek(num_experts=64, groups=8, topk_group=4, top_k=8, hidden=64, seed=0):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(seed)
    r = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=hidden, n_routed_experts=num_experts, n_group=groups,
                                              topk_group=topk_group, num_experts_per_tok=top_k,
                                              routed_scaling_factor=2.5)).eval()
    with torch.no_grad():
        r.weight.normal_(0, hidden ** -0.5)
        r.e_score_correction_bias.normal_(0, 0.05)  # zeros in a fresh model: make the bias matter
    return r


def _same_picks(got_ids, want_ids, scores):
    """Ids equal wherever the picked score is unique in its row; under an exact tie (bf16 logits) any of the
    tied experts is a right pick, so there the picked scores must be equal instead."""
    got_s, want_s = torch.gather(scores, 1, got_ids.long()), torch.gather(scores, 1, want_ids.long())
    assert torch.equal(got_s, want_s)
    unique = (scores.unsqueeze(-1) == want_s.unsqueeze(1)).sum(1) == 1  # [T, k]: no other expert has that score
    assert torch.equal(got_ids.long()[unique], want_ids.long()[unique])
    return int((~unique).sum())


def _tokens(n, hidden, dtype, seed=1):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (16, 4), (60, 4)])  # 60: E not a power of two
def test_softmax_router_picks_the_same_experts_in_the_same_order(num_experts, top_k):
    from dwdp_runtime.kernels import router

    mod = _qwen3(num_experts, top_k)
    x = _tokens(77, 64, torch.bfloat16)
    with torch.no_grad():
        logits, want_w, want_ids = mod(x)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, _ = torch.topk(probs, top_k, dim=-1)
        want_fp32 = top / top.sum(-1, keepdim=True)
    spec = router.of_module(mod, logits.dtype)
    got = router.route(logits, spec)
    _same_picks(got.topk_ids, want_ids, probs)
    assert got.topk_weights.dtype == want_w.dtype == torch.bfloat16
    assert ((got.topk_weights.float() - want_w.float()).abs() <= _bf16_step(want_w)).all()
    fp32 = router.route(logits, router.RouterSpec(num_experts, top_k, weight_dtype=torch.float32))
    assert torch.allclose(fp32.topk_weights, want_fp32, rtol=router.WEIGHT_RTOL, atol=0)


def test_mixtral_router_keeps_fp32_weights():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    from dwdp_runtime.kernels import router

    torch.manual_seed(2)
    mod = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2)).eval()
    with torch.no_grad():
        mod.weight.normal_(0, 0.125)
    mod = mod.to(torch.bfloat16)
    x = _tokens(40, 64, torch.bfloat16, seed=3)
    with torch.no_grad():
        logits, want_w, want_ids = mod(x)
    got = router.route(logits, router.of_module(mod, logits.dtype))
    assert got.topk_weights.dtype == torch.float32 == want_w.dtype
    _same_picks(got.topk_ids, want_ids, torch.softmax(logits.float(), dim=-1))
    assert torch.allclose(got.topk_weights, want_w, rtol=router.WEIGHT_RTOL, atol=0)


@pytest.mark.parametrize("num_experts,groups,topk_group", [(64, 8, 4), (32, 4, 2), (16, 1, 1)])
def test_sigmoid_group_limited_router_picks_the_same_set(num_experts, groups, topk_group):
    from dwdp_runtime.kernels import router

    mod = _deepseek(num_experts, groups, topk_group)
    x = _tokens(45, 64, torch.float32, seed=4)
    with torch.no_grad():
        logits, want_w, want_ids = mod(x)
    spec = router.of_module(mod, logits.dtype)
    assert (spec.score, spec.num_group, spec.topk_group, spec.scale) == ("sigmoid", groups, topk_group, 2.5)
    got = router.route(logits, spec, mod.e_score_correction_bias)
    order_w, order_t = torch.sort(want_ids, dim=-1), torch.sort(got.topk_ids.long(), dim=-1)
    assert torch.equal(order_t.values, order_w.values)  # transformers asks sorted=False: compare the sets
    w_want = torch.gather(want_w, 1, order_w.indices)
    w_got = torch.gather(got.topk_weights, 1, order_t.indices)
    assert torch.allclose(w_got, w_want, rtol=router.WEIGHT_RTOL, atol=0)
    s = torch.sigmoid(logits) + mod.e_score_correction_bias  # ours is descending by the biased choice
    picked = torch.gather(s, 1, got.topk_ids.long())
    assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_the_groups_matter():
    """With group limiting the pick differs from a plain top-k on these logits (so the group path is exercised)."""
    from dwdp_runtime.kernels import router

    mod = _deepseek(64, 8, 2)
    x = _tokens(45, 64, torch.float32, seed=5)
    with torch.no_grad():
        logits = mod(x)[0]
    limited = router.route(logits, router.of_module(mod, logits.dtype), mod.e_score_correction_bias)
    plain = router.route(logits, router.RouterSpec(64, 8, "sigmoid", True, 2.5), mod.e_score_correction_bias)
    assert not torch.equal(limited.topk_ids, plain.topk_ids)


@pytest.mark.parametrize("tokens", [37, 16, 1, 0])
def test_fused_counts_give_the_same_routing_plan_bitwise(tokens):
    from dwdp_runtime.kernels import router, routing

    mod = _qwen3(128, 8)
    x = _tokens(tokens, 64, torch.bfloat16, seed=6)
    with torch.no_grad():
        logits = mod(x)[0]
    got = router.route(logits, router.of_module(mod, logits.dtype))
    assert got.counts is not None  # 128 experts × top-8: 16 tokens per chunk, fused
    for block_m in (16, 64):
        mine = routing.align_routing(got.topk_ids, 128, block_m, counts=got.counts)
        theirs = routing.align_routing(got.topk_ids, 128, block_m)
        for name in ("sorted_pairs", "block_expert", "num_padded", "row_of_pair"):
            a, b = getattr(mine, name), getattr(theirs, name)
            if name == "sorted_pairs":  # rows past num_padded are never written nor read
                n = int(theirs.num_padded)
                a, b = a[:n], b[:n]
            assert torch.equal(a, b), (name, block_m)


def test_a_tokens_routing_does_not_depend_on_its_batch():
    from dwdp_runtime.kernels import router

    mod = _deepseek(64, 8, 4)
    x = _tokens(70, 64, torch.float32, seed=7)
    with torch.no_grad():
        logits = mod(x)[0]
    spec = router.of_module(mod, logits.dtype)
    full = router.route(logits, spec, mod.e_score_correction_bias)
    one = router.route(logits[33:34], spec, mod.e_score_correction_bias)
    assert torch.equal(one.topk_ids, full.topk_ids[33:34]) and torch.equal(one.topk_weights, full.topk_weights[33:34])


def test_moe_block_equals_transformers_router_then_our_experts():
    """``moe_block`` (fused router + experts reading its counts) = transformers' router + ``fused_experts``: the
    same experts, so the output differs only by the weights' last bits (bf16 weights, one step at most)."""
    from dwdp_runtime.kernels import ExpertWeights, fused_experts, router
    from dwdp_runtime.kernels.moe import moe_block

    gen = torch.Generator().manual_seed(8)
    mod = _qwen3(16, 4)
    gu = (torch.randn(16, 64, 64, generator=gen) / 8).bfloat16()
    dn = (torch.randn(16, 64, 32, generator=gen) / 6).bfloat16()
    weights = ExpertWeights(gu, dn)
    x = _tokens(50, 64, torch.bfloat16, seed=9)
    with torch.no_grad():
        _, w, ids = mod(x)
    want = fused_experts(x, ids, w, weights)
    got = moe_block(x, mod.weight, router.of_module(mod, torch.bfloat16), weights)
    assert got.shape == want.shape
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * scale
