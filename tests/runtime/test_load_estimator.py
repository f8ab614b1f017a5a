"""The prefill load signals (dwdp_runtime.load): decayed sums, the per-ISL-bucket estimator, the record.

Pure, CPU only; properties over random streams of samples (hypothesis) where a law holds for all of them.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_runtime.load.decay import Decayed, ratio
from dwdp_runtime.load.estimator import FIRST_PASSES_SKIPPED, SATURATION_HORIZON_S, LoadEstimator, QueueState
from dwdp_runtime.load.forward_model import (FLOOR_WINDOW_S, FLOOR_WINDOWS, ForwardModelFit, bucket_capacity,
                                             combine_costs, mix_capacity)
from dwdp_runtime.load.schema import (ISL_BUCKET_EDGES, NUM_BUCKETS, SCHEMA_VERSION, ForwardCost, LoadReport,
                                      bucket_edge, isl_bucket, parse_report)

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


# -- the measured roofline ------------------------------------------------------------------------------
def _roofline(floor: float, a: float, b: float):
    return lambda lengths: max(floor, a * sum(lengths) + b * sum(n * n for n in lengths))


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 2.0), st.floats(1e-6, 1e-4), st.floats(1e-12, 1e-9), st.integers(0, 10_000))
def test_the_fit_recovers_a_roofline_from_its_forwards(floor, a, b, seed):
    import random
    rng = random.Random(seed)
    truth = _roofline(floor, a, b)
    fit = ForwardModelFit(start=0.0)
    for i in range(400):
        lengths = [rng.randint(256, 65536) for _ in range(rng.randint(1, 4))]
        fit.add(lengths, truth(lengths), float(i))
    cost = fit.cost(400.0)
    assert cost.floor_seconds >= floor * (1 - 1e-9)  # the smallest forward seen: never below the true floor
    for lengths in ([4096] * 4, [65536], [1000, 30000]):
        want = truth(lengths)
        assert cost.seconds(sum(lengths), sum(n * n for n in lengths)) == pytest.approx(want, rel=0.15, abs=0.02 * floor)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 8), st.floats(1e-5, 1e-3), st.lists(st.floats(0.0, 3000.0), min_size=2,
                                                                                  max_size=8))
def test_prompts_of_one_length_give_the_same_cost_at_every_idle_moment(length, per_forward, per_token, idles):
    """Tokens and pairs are proportional when every prompt has one length: both one-term fits are equally
    good, and rounding in the decay of the moment must not flip between them (CI read 1949 and 1615
    tokens/s from one front a tenth of a second apart, with no forward between)."""
    fit = ForwardModelFit(start=0.0)
    fit.add([1], 1e-6, 0.0)  # a tiny forward: the floor, so the forwards below are compute-bound
    for i in range(1, 30):
        n = 1 + i % per_forward
        fit.add([length] * n, per_token * length * n * (1 + 0.01 * (i % 3)), float(i))
    first, *later = (fit.cost(30.0 + idle) for idle in idles)
    for cost in later:
        assert (cost.seconds_per_token, cost.seconds_per_pair) == pytest.approx(
            (first.seconds_per_token, first.seconds_per_pair), rel=1e-12), (first, cost)


def test_without_compute_bound_forwards_only_bigger_ones_cost_more():
    fit = ForwardModelFit(start=0.0)
    for i in range(50):
        fit.add([2000 + 10 * i], 0.7, float(i))   # every forward at the floor (prefetch-bound)
    cost = fit.cost(50.0)
    assert not cost.compute_fitted and cost.floor_seconds == pytest.approx(0.7)
    assert cost.seconds(2000, 2000 ** 2) == pytest.approx(0.7)
    assert cost.seconds(2 * cost.max_tokens, 0) == pytest.approx(1.4)  # proportional beyond what was seen


def test_the_floor_follows_the_last_windows():
    fit = ForwardModelFit(start=0.0)
    fit.add([100], 0.2, 1.0)
    for k in range(1, FLOOR_WINDOWS + 2):
        fit.add([100], 0.5, k * FLOOR_WINDOW_S + 1.0)
    assert fit.floor() == pytest.approx(0.5)  # the fast window aged out


def test_capacity_of_a_floor_bound_model_is_the_packed_tokens_per_floor():
    cost = ForwardCost(floor_seconds=0.5, max_tokens=1e9, max_pairs=1e18, weight=1.0)
    mix = [0.0] * NUM_BUCKETS
    mix[isl_bucket(4000)] = 1.0   # prompts in (2048, 4096]: 4..8 fit a 16K forward
    cap = mix_capacity(cost, mix, 16384)
    assert 0.6 * 16384 / 0.5 < cap <= 16384 / 0.5
    slower = ForwardCost(floor_seconds=0.5, seconds_per_token=1e-4, compute_fitted=True, weight=1.0)
    assert mix_capacity(slower, mix, 16384) < cap
    assert bucket_capacity(cost, isl_bucket(4000), 16384) == pytest.approx(cap)


def test_combined_costs_weigh_young_pods_little():
    old = ForwardCost(floor_seconds=0.7, weight=300.0)
    young = ForwardCost(floor_seconds=3.0, weight=2.0)   # slow first forwards of a new pod
    assert combine_costs([old, young]).floor_seconds == pytest.approx((0.7 * 300 + 3.0 * 2) / 302)
    assert combine_costs([]) is None


# -- the estimator ------------------------------------------------------------------------------------
def _steady(e: LoadEstimator, *, rank=0, lengths=(4000, 4000, 4000, 4000), seconds=0.5, n=50, t0=0.0, dt=1.0,
            arrive=True) -> float:
    t = t0
    for _ in range(n):
        t += dt
        if arrive:
            for length in lengths:
                e.admitted(length, t)
        e.forward_done(rank, list(lengths), seconds, t)
    return t


def test_first_passes_of_each_rank_and_bucket_are_not_model_samples():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    for i in range(FIRST_PASSES_SKIPPED):  # slow first passes (compile, autotune): 10x slower
        e.forward_done(0, [4000] * 4, 5.0, float(i))
    assert e.cost(10.0) is None
    t = _steady(e, t0=10.0)
    assert e.cost(t).floor_seconds == pytest.approx(0.5)
    e.forward_done(1, [4000] * 4, 5.0, t + 1)   # a second rank's first pass is its own: skipped too
    assert e.cost(t + 1).floor_seconds == pytest.approx(0.5)


def test_offered_load_is_arrivals_over_the_packed_capacity():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    t = _steady(e, lengths=(4000,) * 4, seconds=0.5, n=200, dt=0.5)   # 32,000 tokens/s arrive
    r = e.report(QueueState(), ranks=1, ready=True, draining=False, now=t)
    cap = e.capacity(t)
    assert r.offered_load == pytest.approx(32_000 / cap, rel=0.05)
    assert r.busy_fraction == pytest.approx(1.0, rel=0.05)
    assert r.buckets[isl_bucket(4000)].tokens_per_second == pytest.approx(cap, rel=0.01)
    assert [b.isl_le for b in r.buckets] == list(ISL_BUCKET_EDGES) + [None] and len(r.buckets) == NUM_BUCKETS
    assert r.forward_cost is not None and r.max_num_tokens == 16384


def test_lone_prompts_say_nothing_of_bigger_forwards_until_one_is_seen():
    """At low load every DWDP forward carries one short prompt and costs the prefetch floor. Until a bigger
    forward was seen the model charges bigger ones proportionally (conservative); one packed forward at the
    same floor shows what a forward carries under load."""
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    t = _steady(e, lengths=(1500,), seconds=0.8, n=60)
    assert e.capacity(t) == pytest.approx(1500 / 0.8, rel=0.05)
    t = _steady(e, lengths=(1500,) * 10, seconds=0.8, n=3, t0=t, arrive=False)
    assert e.capacity(t + 2) > 5 * 1500 / 0.8  # read after the cache's second


queues = st.lists(st.integers(1, 70_000), max_size=20)


@settings(max_examples=150, deadline=None)
@given(queues, queues, st.integers(1, 70_000), st.integers(1, 8), st.integers(1, 70_000))
def test_ttft_estimate_is_drain_plus_own_forward_and_grows_with_the_queue(waiting, running, length, ranks, extra):
    e = LoadEstimator(max_num_tokens=65536, start=0.0)
    t = _steady(e, lengths=(8000, 8000), seconds=0.4, n=20)
    t = _steady(e, lengths=(30000,), seconds=0.9, n=20, t0=t)
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
        t = _steady(e, n=10, arrive=False)
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
    assert r.ttft_estimate is None and r.saturation == r.busy_fraction == 0.0 and r.forward_cost is None
    assert r.waiting_prefill_tokens == 100 and r.waiting_requests == 1


def test_forward_cv_is_the_spread_of_the_forward_times():
    e = LoadEstimator(max_num_tokens=16384, start=0.0)
    _steady(e, lengths=(4000,), seconds=0.5, n=20)
    assert e.forward_cv(20.0) == pytest.approx(0.0, abs=1e-6)
    for i in range(20):
        e.forward_done(0, [4000], 1.5 if i % 2 else 0.5, 21.0 + i)
    assert 0.2 < e.forward_cv(41.0) < 0.6
