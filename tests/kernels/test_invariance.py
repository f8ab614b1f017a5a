"""Fixed-order reduction and batch invariance, bitwise, under Triton's interpreter."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_reduce_is_a_fixed_order_fp32_sum():
    from dwdp_runtime.kernels.reduce import reduce_topk

    gen = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 9, 5, 1100  # hidden > BLOCK_H: a ragged second column block
    y = (torch.randn(tokens * top_k, hidden, generator=gen) * 100).bfloat16()
    ids = torch.randint(0, 4, (tokens, top_k), generator=gen)
    got = reduce_topk(y, ids, num_experts=4)
    acc = torch.zeros(tokens, hidden, dtype=torch.float32)
    for j in range(top_k):  # the documented order: j = 0, 1, …, k-1, in fp32
        acc = acc + y.view(tokens, top_k, hidden)[:, j].float()
    assert torch.equal(got, acc.bfloat16())


def test_a_tokens_output_does_not_depend_on_its_batch():
    """Rows alone vs packed into a 16× larger batch (another load bucket, hence another BLOCK_M): bitwise."""
    from dwdp_runtime.kernels import ExpertWeights, fused_experts, tuning

    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, top_k = 4, 64, 32, 2
    gu = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).bfloat16()
    dn = (torch.randn(experts, hidden, inter, generator=gen) / 6).bfloat16()
    x = torch.randn(128, hidden, generator=gen).bfloat16()
    w, ids = torch.topk(torch.rand(128, experts, generator=gen).softmax(-1), top_k, dim=-1)
    alone = slice(50, 58)
    small, large = tuning.load_bucket(8, top_k, experts), tuning.load_bucket(128, top_k, experts)
    def m(load):
        return tuning.default_config(tuning.ShapeKey("gate_up", inter, hidden, experts, top_k, "bfloat16", load)).block_m
    assert m(small) != m(large)  # the two batches really take different tilings
    weights = ExpertWeights(gu, dn)
    packed = fused_experts(x, ids, w, weights)
    single = fused_experts(x[alone], ids[alone], w[alone], weights)
    assert torch.equal(single, packed[alone])
