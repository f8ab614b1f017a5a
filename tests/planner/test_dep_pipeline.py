"""DEP baseline arithmetic (all-to-all volume, expected maxima) and the two-stream pipeline."""

import math

import pytest

from dwdp_runtime.planner import dep, pipeline


def test_expected_max_of_std_normals_exact_values():
    assert dep.expected_max_std_normal(1) == pytest.approx(0.0, abs=1e-9)
    assert dep.expected_max_std_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert dep.expected_max_std_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    assert dep.expected_max_std_normal(4) == pytest.approx(1.0293753, rel=1e-5)  # tabulated value


def test_expected_slowest_linear_work():
    # work linear in length: E[max of 2] = 1 + cv * E[max Z] = 1 + 0.1/sqrt(pi)
    assert dep.expected_slowest(lambda s: s, d=2, cv=0.1) == pytest.approx(1 + 0.1 / math.sqrt(math.pi), rel=1e-6)
    assert dep.expected_slowest(lambda s: s, d=4, cv=0.0) == 1.0
    # quadratic work: mean of (1 + cv Z)^2 = 1 + cv^2
    assert dep.expected_mean(lambda s: s * s, cv=0.1) == pytest.approx(1.01, rel=1e-6)


def test_remote_ranks_per_token_by_hand():
    # E = 4 experts, top-2, d = 2 ranks of 2 experts: a token misses a rank only if both picks are on
    # the other rank: C(2,2)/C(4,2) = 1/6 -> hit 5/6 per rank; remote share (d-1)/d = 1/2 of 2 * 5/6
    assert dep.remote_ranks_per_token(num_experts=4, top_k=2, d=2) == pytest.approx(5 / 6)
    # 6 tokens, hidden 2: dispatch 6 * 5/6 * 2 elems * 2 B = 20 B; combine the same at bf16
    assert dep.all2all_bytes(tokens=6, hidden=2, num_experts=4, top_k=2, d=2,
                             dispatch_bytes_per_elem=2) == pytest.approx((20.0, 20.0))
    # top-1: the token goes to exactly one rank, remote with probability (d-1)/d
    assert dep.remote_ranks_per_token(num_experts=8, top_k=1, d=4) == pytest.approx(3 / 4)


def test_pipeline_prefetch_bound():
    """2 MoE layers, pre = moe = 1 s, copy 3 s, 2 slots (hand timeline):
    p0 copy [0,3], MoE [3,4]; p1 copy [3,6], attention ends 5, MoE [6,7]  -> cold 7
    p2 copy [6,9] (slot freed at 4), attention ends 8, MoE [9,10]
    p3 copy [9,12] (slot freed at 7), attention ends 11, MoE [12,13]     -> steady 13 - 7 = 6 = 2 x 3
    """
    t = pipeline.simulate(pre=[1, 1], moe=[1, 1], post=0, t_prefetch=3, slots=2)
    assert (t.cold_s, t.steady_s, t.compute_s, t.stall_s) == (7, 6, 4, 2)


def test_pipeline_compute_bound_hides_copies():
    t = pipeline.simulate(pre=[1, 1], moe=[1, 1], post=0, t_prefetch=0.5, slots=2)
    assert t.steady_s == 4 and t.stall_s == 0  # steady state: no waiting at all


def test_pipeline_one_slot_serialises():
    """1 slot: the copy for p waits for MoE p-1 to finish. pre = moe = 1, copy 2:
    p0 copy [0,2], MoE [2,3]; p1 copy [3,5], MoE [5,6] -> cold 6
    p2 copy [6,8], MoE [8,9]; p3 copy [9,11], MoE [11,12] -> steady 6
    With 2 slots copies run back to back: p1 copy [2,4] MoE [4,5]; p2 copy [4,6] (slot of p0 free at 3)
    MoE [6,7]; p3 copy [6,8] (free at 5) MoE [8,9] -> steady 9 - 5 = 4."""
    assert pipeline.simulate(pre=[1, 1], moe=[1, 1], post=0, t_prefetch=2, slots=1).steady_s == 6
    assert pipeline.simulate(pre=[1, 1], moe=[1, 1], post=0, t_prefetch=2, slots=2).steady_s == 4
