"""Property tests of the composite layout and the copy plan (pure integer math)."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dwdp_runtime.config import sharding_errors
from dwdp_runtime.layout import (
    SLICE_BYTES, composite_layout, copy_plan, lookup_owner, peer_ranges, remote_bytes, slice_round_robin,
    slot_pool_pages,
)


@st.composite
def groups(draw):
    d = draw(st.integers(2, 6))
    n = draw(st.integers(d, 40))
    # drawn inside the coverage rules ((d-1)*s < n, (d-1)*s + k >= n, s <= k) rather than filtered into them:
    # filtering threw away most draws and failed Hypothesis' filter_too_much health check at random
    s = draw(st.integers(1, (n - 1) // (d - 1)))
    k = draw(st.integers(max(s, n - (d - 1) * s), n))
    assume(not sharding_errors(dwdp_size=d, num_experts=n, num_experts_per_worker=k, num_prefetch_experts=s))
    eb = draw(st.one_of(st.integers(1, 5000), st.sampled_from([4096, 8192, 3 << 20, (2 << 20) + 16])))
    gran = draw(st.sampled_from([64, 4096, 2 << 20]))
    mult = draw(st.sampled_from([1, 2, 8]))
    rank = draw(st.integers(0, d - 1))
    contention = draw(st.booleans())
    return d, n, k, s, eb, gran, mult, rank, contention


def test_peer_ranges_and_owner_rule():
    ranges = peer_ranges(dwdp_size=3, num_experts=256, num_experts_per_worker=86, num_prefetch_experts=85)
    assert ranges == ((0, 86), (85, 171), (170, 256))
    assert lookup_owner(85, ranges) == 0  # overlap → lowest rank
    assert lookup_owner(170, ranges) == 1
    assert lookup_owner(255, ranges) == 2


def _merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@settings(max_examples=400, deadline=None)
@given(groups())
def test_every_expert_byte_covered_exactly_once(g):
    d, n, k, s, eb, gran, mult, rank, contention = g
    ranges = peer_ranges(dwdp_size=d, num_experts=n, num_experts_per_worker=k, num_prefetch_experts=s)
    lay = composite_layout(num_experts=n, expert_bytes=eb, local_range=ranges[rank], granularity=gran,
                           page_multiplier=mult)
    page = gran * mult
    # hardware rules: pages and the local handle are whole; expert a at offset 0 of the local handle
    assert lay.local_offset % page == 0 and lay.local_bytes % gran == 0
    assert 0 <= lay.pre_padding < page or (lay.n_pre == 0 and lay.pre_padding == 0)
    assert lay.pre_padding + lay.local_start * eb == lay.local_offset
    assert lay.pre_padding + lay.tensor_bytes <= lay.total_bytes
    # tensor bytes partition: local interval and pool intervals, disjoint, covering [0, E*eb)
    parts = [lay.local_interval(), *lay.pool_intervals()]
    assert sum(hi - lo for lo, hi in parts) == lay.tensor_bytes
    assert _merge(parts) == [(0, lay.tensor_bytes)]
    # pool intervals lie inside pool pages (reservation offsets outside the local handle)
    for lo, hi in lay.pool_intervals():
        r_lo, r_hi = lo + lay.pre_padding, hi + lay.pre_padding
        assert r_hi <= lay.local_offset or r_lo >= lay.post_offset


@settings(max_examples=400, deadline=None)
@given(groups())
def test_copy_plan_moves_exactly_the_remote_bytes(g):
    d, n, k, s, eb, gran, mult, rank, contention = g
    ranges = peer_ranges(dwdp_size=d, num_experts=n, num_experts_per_worker=k, num_prefetch_experts=s)
    lay, ops, setup = copy_plan(num_experts=n, expert_bytes=eb, rank=rank, ranges=ranges, granularity=gran,
                                page_multiplier=mult, contention_opt=contention)
    # no run-time copy targets the local handle
    for op in ops:
        assert op.dst_offset + op.nbytes <= lay.local_offset or op.dst_offset >= lay.post_offset
        assert op.peer != rank or not (ranges[rank][0] <= (op.dst_offset - lay.pre_padding) // eb < ranges[rank][1])
    # the union of destinations is exactly the pool intervals, without overlap
    dst = [(op.dst_offset - lay.pre_padding, op.dst_offset - lay.pre_padding + op.nbytes) for op in ops]
    assert sum(hi - lo for lo, hi in dst) == remote_bytes(lay)
    assert _merge(dst) == _merge(lay.pool_intervals())
    # every byte comes from the owner's handle at the right place
    for op in ops + setup:
        t = op.dst_offset - lay.pre_padding
        first, last = t // eb, (t + op.nbytes - 1) // eb
        for e in {first, last}:
            assert lookup_owner(e, ranges) == op.peer
        a_p, b_p = ranges[op.peer]
        assert op.src_offset == t - a_p * eb
        assert op.src_offset + op.nbytes <= (b_p - a_p) * eb
    # setup fill writes only the local handle's tail (beyond the local experts)
    for op in setup:
        assert lay.local_offset + (lay.local_end - lay.local_start) * eb <= op.dst_offset
        assert op.dst_offset + op.nbytes <= lay.post_offset
    if contention:
        assert all(op.nbytes <= SLICE_BYTES for op in ops)


def test_round_robin_interleaves_peers():
    from dwdp_runtime.layout import CopyOp

    ops = [CopyOp(0, 0, 0, 3 * SLICE_BYTES), CopyOp(2, 0, 10 * SLICE_BYTES, 2 * SLICE_BYTES)]
    out = slice_round_robin(ops)
    assert [op.peer for op in out] == [0, 2, 0, 2, 0]
    assert sum(op.nbytes for op in out) == 5 * SLICE_BYTES


def test_straddling_expert_is_filled_at_setup():
    # 2 ranks, 5 experts of 3000 bytes, granularity 4096: rank 0 holds [0,3) = 9000 B → handle 12288 B,
    # so 3288 B of expert 3 (owned by rank 1) sit in rank 0's handle tail: filled once at setup.
    ranges = peer_ranges(dwdp_size=2, num_experts=5, num_experts_per_worker=3, num_prefetch_experts=2)
    lay, ops, setup = copy_plan(num_experts=5, expert_bytes=3000, rank=0, ranges=ranges, granularity=4096,
                                page_multiplier=1)
    assert lay.local_bytes == 12288 and lay.pre_padding == 0
    assert [(op.peer, op.src_offset, op.dst_offset, op.nbytes) for op in setup] == [(1, 3000, 9000, 3288)]
    assert sum(op.nbytes for op in ops) == 15000 - 12288


def test_slot_pool_sized_by_largest_layer():
    assert slot_pool_pages([3, 5, 2, 7, 1], 2) == [3, 7]


# -- replicas (expert_replicas = r) -----------------------------------------------------------------
from dwdp_runtime.layout import (  # noqa: E402 - grouped with the tests that use them
    NoSurvivingHolder, coverage, holder_layout, source_runs, surviving_owner, uncovered_experts,
)


@st.composite
def replica_groups(draw):
    d, n, k, s, eb, gran, mult, rank, contention = draw(groups())
    r = draw(st.integers(1, d))
    lost = draw(st.sets(st.integers(0, d - 1), max_size=d - 1))
    return d, n, k, s, r, eb, gran, mult, rank, contention, lost


def _holders(d, n, k, s, r):
    return holder_layout(dwdp_size=d, num_experts=n, num_experts_per_worker=k, num_prefetch_experts=s,
                         expert_replicas=r)


def test_replicas_one_is_todays_layout_exactly():
    h = _holders(3, 256, 86, 85, 1)
    assert h.primary == peer_ranges(dwdp_size=3, num_experts=256, num_experts_per_worker=86, num_prefetch_experts=85)
    assert h.replicas == ((), (), ())
    assert coverage(h) == 1 and coverage(h, {1}) == 0


def test_ring_replicas_group_of_four():
    h = _holders(4, 8, 2, 2, 2)
    assert h.primary == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert h.replicas == (((6, 8),), ((0, 2),), ((2, 4),), ((4, 6),))  # each rank keeps its predecessor's
    assert [h.holders(e) for e in (0, 3, 7)] == [(0, 1), (1, 2), (0, 3)]
    assert coverage(h) == 2
    assert coverage(h, {1}) == 1 and coverage(h, {1, 2}) == 0
    assert uncovered_experts(h, {1, 2}) == (2, 3)
    assert surviving_owner(2, h, {0, 1, 2, 3}) == 1      # everyone alive: the primary holder
    assert surviving_owner(2, h, {0, 2, 3}) == 2         # rank 1 lost: its successor's replica
    with pytest.raises(NoSurvivingHolder, match="expert 2 has no surviving holder"):
        surviving_owner(2, h, {0, 3})


@settings(max_examples=300, deadline=None)
@given(replica_groups())
def test_every_expert_on_r_ranks_and_survivors_pull_only_from_survivors(g):
    d, n, k, s, r, eb, gran, mult, rank, contention, lost = g
    h = _holders(d, n, k, s, r)
    assert all(len(h.holders(e)) >= r for e in range(n))
    for i in range(d):  # replica runs: disjoint from the primary and from each other
        stored = [e for a, b in h.stored(i) for e in range(a, b)]
        assert len(stored) == len(set(stored))
        assert h.stored_experts(i) <= min(n, r * k)
    assert coverage(h) >= r
    direct = min(sum(1 for x in h.holders(e) if x not in lost) for e in range(n))
    assert coverage(h, lost) == direct >= r - len(lost)
    assert (direct == 0) == bool(uncovered_experts(h, lost))
    alive = frozenset(range(d)) - lost
    if rank not in alive:
        return
    # with everyone alive the survivor plan is today's plan
    full = copy_plan(num_experts=n, expert_bytes=eb, rank=rank, ranges=h.primary, granularity=gran,
                     page_multiplier=mult, contention_opt=contention)
    same = copy_plan(num_experts=n, expert_bytes=eb, rank=rank, ranges=h.primary, granularity=gran,
                     page_multiplier=mult, contention_opt=contention, holders=h, alive=frozenset(range(d)))
    assert full == same
    if uncovered_experts(h, lost):
        with pytest.raises(NoSurvivingHolder):
            copy_plan(num_experts=n, expert_bytes=eb, rank=rank, ranges=h.primary, granularity=gran,
                      page_multiplier=mult, contention_opt=contention, holders=h, alive=alive)
        return
    layout, ops, _ = copy_plan(num_experts=n, expert_bytes=eb, rank=rank, ranges=h.primary, granularity=gran,
                               page_multiplier=mult, contention_opt=contention, holders=h, alive=alive)
    assert sum(op.nbytes for op in ops) == remote_bytes(layout)      # still exactly the remote bytes
    for op in ops:
        assert op.peer in alive
        a, b = h.stored(op.peer)[op.handle]
        assert 0 <= op.src_offset and op.src_offset + op.nbytes <= (b - a) * eb  # inside that allocation
        t = op.dst_offset - layout.pre_padding
        first = t // eb
        assert op.src_offset == t - a * eb and a <= first < b  # the same expert bytes, from a holder


def test_source_runs_merge_per_allocation():
    h = _holders(4, 8, 2, 2, 2)
    assert source_runs(0, 8, h.primary) == [(0, 0, 0, 0, 2), (1, 0, 2, 2, 4), (2, 0, 4, 4, 6), (3, 0, 6, 6, 8)]
    assert source_runs(0, 8, h.primary, h, frozenset({0, 2, 3})) == [
        (0, 0, 0, 0, 2), (2, 1, 2, 2, 4), (2, 0, 4, 4, 6), (3, 0, 6, 6, 8)]
