"""``align_routing`` under Triton's interpreter: exact pair lists and block maps, edge cases included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.kernels.reference import routing_lists  # noqa: E402


def _check(ids, num_experts, block_m):
    from dwdp_runtime.kernels.routing import align_routing, max_padded_blocks

    plan = align_routing(ids, num_experts, block_m)
    pairs, blocks = routing_lists(ids, num_experts, block_m)
    n = int(plan.num_padded[0])
    assert n == len(pairs)
    assert plan.sorted_pairs[:n].tolist() == pairs
    assert plan.block_expert[: n // block_m].tolist() == blocks
    assert (plan.block_expert[n // block_m:] == -1).all()
    assert plan.max_blocks == max(1, max_padded_blocks(ids.numel(), num_experts, block_m)) >= n // block_m
    return plan


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (37, 2, 5, 16),      # ragged tails in every expert
    (100, 8, 128, 64),   # most experts get a partial block
    (64, 8, 130, 32),    # E not a power of two, > 128 (two one-hot widths)
    (1, 1, 1, 16),       # one token, one expert
    (50, 3, 13, 16),     # E not a multiple of anything
    (600, 2, 7, 128),    # several chunks of the count/scatter kernels
])
def test_random_routing_matches_reference(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    scores = torch.rand(tokens, experts, generator=gen)
    ids = torch.topk(scores, top_k, dim=-1).indices
    _check(ids, experts, block_m)


def test_empty_experts_get_no_blocks():
    ids = torch.tensor([[0, 5], [5, 0], [0, 5], [8, 0]])  # experts 1-4, 6, 7 unused
    plan = _check(ids, 9, 16)
    assert sorted(set(plan.block_expert.tolist()) - {-1}) == [0, 5, 8]


def test_one_expert_takes_every_token():
    ids = torch.full((70, 1), 3, dtype=torch.long)
    plan = _check(ids, 6, 16)
    assert int(plan.num_padded[0]) == 80                       # 70 rows → 5 blocks of 16
    assert plan.sorted_pairs[70:80].tolist() == [70] * 10      # sentinel = num_pairs in the tail


def test_out_of_range_ids_are_dropped():
    ids = torch.tensor([[0, 9], [-1, 1], [1, 0]])              # 9 and -1: expert-parallel sentinels
    plan = _check(ids, 3, 16)
    live = plan.sorted_pairs[: int(plan.num_padded[0])]
    assert sorted(p for p in live.tolist() if p < 6) == [0, 3, 4, 5]


def test_int32_ids_and_determinism():
    from dwdp_runtime.kernels.routing import align_routing

    ids = torch.randint(0, 11, (90, 4), generator=torch.Generator().manual_seed(3)).int()
    _check(ids, 11, 32)
    a, b = align_routing(ids, 11, 32), align_routing(ids, 11, 32)
    assert torch.equal(a.sorted_pairs[: int(a.num_padded[0])], b.sorted_pairs[: int(b.num_padded[0])])


def test_bad_arguments_are_refused():
    from dwdp_runtime.kernels.routing import align_routing

    with pytest.raises(ValueError, match="power of two"):
        align_routing(torch.zeros(4, 2, dtype=torch.long), 4, 24)
    with pytest.raises(ValueError, match="tokens, top_k"):
        align_routing(torch.zeros(8, dtype=torch.long), 4, 16)
