"""The prefill load signals (dwdp_runtime.load): decayed sums, the per-ISL-bucket estimator, the record.

Pure, CPU only; properties over random streams of samples (hypothesis) where a law holds for all of them.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_runtime.load.decay import Decayed, ratio
from dwdp_runtime.load.estimator import (FIRST_PASSES_SKIPPED, SATURATION_HORIZON_S, LoadEstimator, QueueState,
                                         fill_nearest, work)
from dwdp_runtime.load.schema import (ISL_BUCKET_EDGES, NUM_BUCKETS, SCHEMA_VERSION, LoadReport, bucket_edge,
                                      isl_bucket, parse_report)

lengths = st.integers(1, 200_000)


# -- decay ---------------------------------------------------------------------------------------------
@given(st.floats(0.1, 1000), st.floats(0.01, 10), st.integers(50, 400))
def test_rate_of_a_steady_stream_is_its_rate(rate, dt, n):
    """n samples of rate·dt every dt seconds: the decayed rate is the stream's, up to the half sample the
    last one adds (the discretization: at most a factor (1 + dt·ln2/h) above)."""
    d = Decayed(half_life_s=10.0, since=0.0)
    for i in range(1, n + 1):
        d.add(rate * dt, i * dt)
    got = d.rate(n * dt)
    assert rate * 0.85 <= got <= rate * (1 + dt * math.log(2) / 10.0) * 1.05 + 1e-9


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 1e6)), min_size=1, max_size=30), st.floats(0, 1000))
def test_a_sum_only_decays_between_samples_and_a_clock_step_back_decays_nothing(samples, later):
    d = Decayed(half_life_s=5.0, since=0.0)
    t = 0.0
    for dt, x in samples:
        t += dt
        d.add(x, t)
    v = d.value(t)
    assert 0 <= d.value(t + later) <= v + 1e-9
    assert d.value(t - 50.0) == pytest.approx(v)  # dt clamped at 0


@given(st.floats(1, 1e5), st.floats(0.01, 100), st.floats(0, 10_000))
def test_a_ratio_does_not_move_while_idle(tokens, seconds, idle):
    num, den = Decayed(60.0, 0.0), Decayed(60.0, 0.0)
    num.add(tokens, 1.0)
    den.add(seconds, 1.0)
    assert ratio(num, den, 1.0 + idle) == pytest.approx(tokens / seconds)


def test_a_young_sum_is_not_biased_low():
    """Two seconds after start at 100 tokens/s, the rate is 100, not 100 × (2 s / the full window)."""
    d = Decayed(half_life_s=10.0, since=0.0)
    for i in range(1, 21):
        d.add(10.0, i * 0.1)
    assert d.rate(2.0) == pytest.approx(100.0, rel=0.05)


def test_half_life_must_be_positive():
    with pytest.raises(ValueError, match="half_life_s"):
        Decayed(half_life_s=0.0, since=0.0)


# -- buckets and the record ----------------------------------------------------------------------------
@given(lengths)
def test_a_length_falls_in_the_bucket_whose_range_holds_it(n):
    b = isl_bucket(n)
    hi = bucket_edge(b)
    lo = bucket_edge(b - 1) if b > 0 else 0
    assert lo < n and (hi is None or n <= hi)


def test_parse_report_refuses_unknown_versions_and_ignores_unknown_fields():
    r = LoadReport(ready=True, ranks=2, saturation=0.5)
    raw = r.model_dump(mode="json")
    assert parse_report(raw) == r
    assert parse_report({**raw, "health": {"peers": 3}}) == r  # a later optional field: ignored here
    assert parse_report({**raw, "schema_version": SCHEMA_VERSION + 1}) is None
    assert parse_report({**raw, "saturation": 3.0}) is None
    assert parse_report(["not", "an", "object"]) is None
    assert parse_report({}) == LoadReport()  # an old worker with none of the fields: defaults


# -- the estimator ------------------------------------------------------------------------------------
def _steady(e: LoadEstimator, *, rank=0, length=4000, per_forward=4, seconds=0.5, n=50, t0=0.0, dt=1.0) -> float:
    t = t0
    for _ in range(n):
        t += dt
        for _ in range(per_forward):
            e.admitted(length, t)
        e.forward_done(rank, [length] * per_forward, seconds, t)
    return t


def test_throughput_is_the_forwards_tokens_per_second_after_the_first_passes():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    for i in range(FIRST_PASSES_SKIPPED):  # slow first passes (compile, autotune): 10x slower, not counted
        e.forward_done(0, [4000] * 4, 5.0, float(i))
    assert e.throughput(10.0)[isl_bucket(4000)] is None
    t = _steady(e, t0=10.0)
    assert e.throughput(t)[isl_bucket(4000)] == pytest.approx(16000 / 0.5)
    # a second rank's first passes are its own: skipped too
    e.forward_done(1, [4000] * 4, 5.0, t + 1)
    assert e.throughput(t + 1)[isl_bucket(4000)] == pytest.approx(32000)


def test_full_forwards_outweigh_lone_ones():
    """A DWDP forward costs a prefetch floor: a lone 1K prompt measures the floor, not the capacity."""
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    t = _steady(e, length=1000, per_forward=1, seconds=0.8, n=40)           # 1,250 tokens/s alone
    t = _steady(e, length=1000, per_forward=16, seconds=1.0, n=40, t0=t)    # 16,000 tokens/s packed
    tput = e.throughput(t)[isl_bucket(1000)]
    assert 12_000 < tput < 16_000
    unweighted = (40 * 1000 + 40 * 16000) / (40 * 0.8 + 40 * 1.0)
    assert tput > 1.5 * unweighted  # the plain ratio of sums would say 9,444


@given(st.lists(st.one_of(st.none(), st.floats(1, 1e6)), min_size=1, max_size=12))
def test_fill_nearest_keeps_measured_rates_and_borrows_the_nearest(tput):
    out = fill_nearest(tput)
    known = [i for i, v in enumerate(tput) if v is not None]
    if not known:
        assert out == [None] * len(tput)
        return
    for i, v in enumerate(out):
        if tput[i] is not None:
            assert v == tput[i]
        else:
            dist = min(abs(k - i) for k in known)
            assert v in [tput[k] for k in known if abs(k - i) == dist]


def test_work_is_tokens_over_rate_and_unknown_without_any_rate():
    assert work([1000, 0, 3000], [1000.0, None, 1500.0]) == pytest.approx(3.0)
    assert work([0, 0], [None, None]) == 0.0
    assert work([5, 0], [None, None]) is None


queues = st.lists(st.integers(1, 70_000), max_size=20)


@settings(max_examples=150, deadline=None)
@given(queues, queues, st.integers(1, 70_000), st.integers(1, 8), st.integers(1, 70_000))
def test_ttft_estimate_is_drain_plus_own_forward_and_grows_with_the_queue(waiting, running, length, ranks, extra):
    e = LoadEstimator(max_num_tokens=65536, start=0.0)
    t = _steady(e, length=8000, per_forward=2, seconds=0.4, n=20)
    t = _steady(e, length=30000, per_forward=1, seconds=0.9, n=20, t0=t)
    q = QueueState.of(waiting, running)
    report = e.report(q, ranks=ranks, ready=True, draining=False, now=t, isl=length)
    est = e.ttft_estimate(length, q, ranks, t)
    assert report.ttft_estimate.seconds == pytest.approx(est)
    assert report.drain_seconds == pytest.approx(report.backlog_seconds / ranks)
    assert est >= report.drain_seconds + (e.forward_seconds(t) or 0.0) - 1e-9
    more = QueueState.of(waiting + [extra], running)
    assert e.ttft_estimate(length, more, ranks, t) > est
    assert e.ttft_estimate(length, q, ranks + 1, t) <= est + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 8))
def test_saturation_is_a_share_and_grows_with_offered_load(per_second, queued, ranks):
    def saturation(arrivals_per_step: int) -> float:
        e = LoadEstimator(max_num_tokens=16384, start=0.0)
        t = _steady(e, length=4000, per_forward=4, seconds=0.5, n=10)  # 32,000 tokens/s per rank
        for _ in range(20):
            t += 1.0
            for _ in range(arrivals_per_step):
                e.admitted(4000, t)
        r = e.report(QueueState.of([4000] * queued, []), ranks=ranks, ready=True, draining=False, now=t)
        assert 0.0 <= r.saturation <= 1.0
        expected = (r.offered_load + r.backlog_seconds / SATURATION_HORIZON_S) / ranks
        assert r.saturation == pytest.approx(min(1.0, max(r.busy_fraction, expected)))
        return r.saturation
    assert saturation(per_second + 5) >= saturation(per_second)


def test_offered_load_is_the_arrivals_work_per_second():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    t = _steady(e, length=4000, per_forward=4, seconds=0.5, n=200, dt=0.5)  # 32,000 tokens/s; 32,000 arrive per s
    r = e.report(QueueState(), ranks=1, ready=True, draining=False, now=t)
    assert r.offered_load == pytest.approx(1.0, rel=0.05)  # the one rank is exactly busy
    assert r.busy_fraction == pytest.approx(1.0, rel=0.05)
    assert [b.isl_le for b in r.buckets] == list(ISL_BUCKET_EDGES) + [None] and len(r.buckets) == NUM_BUCKETS


def test_ttft_correction_is_observed_over_predicted():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    for i in range(30):
        e.first_token(1.5, 1.0, float(i))
        e.first_token(0.2, None, float(i))  # no prediction (nothing measured yet): not in the correction
    r = e.report(QueueState(), ranks=1, ready=True, draining=False, now=30.0)
    assert r.ttft_correction == pytest.approx(1.5)
    assert r.ttft_observed_seconds == pytest.approx(0.85)
    assert 25 < r.ttft_correction_weight <= 30


def test_nothing_measured_reports_no_work_and_busy_as_saturation():
    e = LoadEstimator(max_num_tokens=8192, start=0.0)
    e.admitted(100, 1.0)
    r = e.report(QueueState.of([100], []), ranks=2, ready=False, draining=False, now=2.0)
    assert r.offered_load is None and r.backlog_seconds is None and r.drain_seconds is None
    assert r.ttft_estimate is None and r.saturation == r.busy_fraction == 0.0
    assert r.waiting_prefill_tokens == 100 and r.waiting_requests == 1
