"""Source-contention model against exact enumeration, and the prefetch traffic/time by hand."""

import itertools
import math
from fractions import Fraction

import pytest

from dwdp_runtime.planner import contention, prefetch


def test_paper_number_n3():
    # N = 3: X ~ Binomial(1, 1/2) -> P(C = 1) = P(X = 0) = 0.5 (the paper's number)
    pmf = contention.contention_pmf(3)
    assert pmf[1] == pytest.approx(0.5) and pmf[2] == pytest.approx(0.5)


def test_n4_by_hand():
    # N = 4: X ~ Binomial(2, 1/3): P(0) = 4/9, P(1) = 2*(1/3)*(2/3) = 4/9, P(2) = 1/9
    pmf = contention.contention_pmf(4)
    assert [pmf[c] for c in (1, 2, 3)] == pytest.approx([4 / 9, 4 / 9, 1 / 9])
    assert contention.expected_contention(4) == pytest.approx(1 + 2 / 3)  # 1 + (N-2)/(N-1)
    assert contention.expected_contention(2) == 1.0                      # a pair never contends


@pytest.mark.parametrize("n", [3, 4, 5])
def test_binomial_matches_exact_enumeration(n):
    """Enumerate every choice: tagged rank 0 pulls from source 1 (by symmetry); each of the N-2 other
    non-source ranks picks one of its N-1 peers uniformly. C = 1 + #others that picked source 1."""
    others = [r for r in range(2, n)]
    counts = {}
    choices = [[p for p in range(n) if p != r] for r in others]
    for combo in itertools.product(*choices):
        c = 1 + sum(1 for pick in combo if pick == 1)
        counts[c] = counts.get(c, 0) + 1
    total = math.prod(len(ch) for ch in choices)
    pmf = contention.contention_pmf(n)
    for c, cnt in counts.items():
        assert pmf[c] == pytest.approx(float(Fraction(cnt, total)))
    assert sum(pmf.values()) == pytest.approx(1.0)


def test_open_shop_makespan():
    # m[dst][src] bytes
    m = [[0, 3, 1],
         [2, 0, 0],
         [2, 2, 0]]
    # row sums (ingress) 4, 2, 4; column sums (egress) 4, 5, 1 -> makespan 5 / bw 2 = 2.5
    assert contention.open_shop_makespan(m, 2.0) == 2.5


SMALL = dict(dwdp_size=3, num_experts=8, experts_per_worker=4, stride=2)


def test_ranges_and_lowest_rank_owner():
    # rank r owns [r*s, min(r*s + k, N)) = [0,4), [2,6), [4,8)
    ranges = prefetch.expert_ranges(**SMALL)
    assert ranges == [(0, 4), (2, 6), (4, 8)]
    assert prefetch.owned(ranges) == [(0, 4), (4, 6), (6, 8)]      # lowest rank serves overlaps
    assert [prefetch.owner(e, ranges) for e in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]


def test_traffic_by_hand_and_by_brute_force():
    ranges = prefetch.expert_ranges(**SMALL)
    # dst0 holds 0-3: pulls 4,5 from r1 and 6,7 from r2; dst1 holds 2-5: 0,1 from r0, 6,7 from r2;
    # dst2 holds 4-7: 0-3 from r0.
    m = prefetch.traffic(ranges, 8)
    assert m == [[0, 2, 2], [2, 0, 2], [4, 0, 0]]
    brute = [[0] * 3 for _ in range(3)]
    for dst, (a, b) in enumerate(ranges):
        for e in range(8):
            if not a <= e < b:
                brute[dst][prefetch.owner(e, ranges)] += 1
    assert m == brute


def test_prefetch_time_by_hand():
    m = prefetch.traffic(prefetch.expert_ranges(**SMALL), 8)
    # 1 byte per expert, 1 B/s: every rank receives 4 (ideal 4 s) but rank 0 serves 2 + 4 = 6
    rr = prefetch.layer_prefetch_time(traffic_matrix=m, expert_bytes=1.0, link_bytes_per_s=1.0, contention_opt=True)
    assert (rr.ideal_s, rr.time_s) == (4.0, 6.0)
    # serial copies: 4 * E[C](N=3) = 4 * 1.5 = 6, and at least the makespan 6
    serial = prefetch.layer_prefetch_time(traffic_matrix=m, expert_bytes=1.0, link_bytes_per_s=1.0,
                                          contention_opt=False)
    assert serial.time_s == pytest.approx(6.0) and serial.remote_experts_max == 4


def test_even_split_round_robin_has_no_contention_penalty():
    # d = 4, N = 8, k = s = 2: each rank pulls 2 from each peer, serves 2 to each: makespan = ideal
    m = prefetch.traffic(prefetch.expert_ranges(dwdp_size=4, num_experts=8, experts_per_worker=2, stride=2), 8)
    rr = prefetch.layer_prefetch_time(traffic_matrix=m, expert_bytes=2.0, link_bytes_per_s=4.0, contention_opt=True)
    assert rr.time_s == rr.ideal_s == 6 * 2.0 / 4.0
    serial = prefetch.layer_prefetch_time(traffic_matrix=m, expert_bytes=2.0, link_bytes_per_s=4.0,
                                          contention_opt=False)
    assert serial.time_s == pytest.approx(3.0 * 5 / 3)


def test_invalid_sharding_is_refused_with_the_runtime_message():
    with pytest.raises(ValueError, match="coverage rule"):
        prefetch.expert_ranges(dwdp_size=2, num_experts=8, experts_per_worker=2, stride=2)
