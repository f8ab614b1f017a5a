"""The autoscaling law (dwdp_operator.autoscale), its queue model and the fleet signals: pure, CPU only.

Properties over random signals where a law must hold for all of them (bounds, monotonicity), and the
named behaviours of docs/OPERATOR.md (panic, stabilization windows, scale-down with margin, max step)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_operator.autoscale import (BACKLOG_HORIZON_S, CORRECTION_MIN_WEIGHT, PANIC_HOLD_S, QueueShape,
                                     ScaleHistory, ScaleReason, correction, decide, recommend, wait_budget)
from dwdp_operator.autoscale_queue import MAX_UTILIZATION, erlang_c, servers_for, wait_tail
from dwdp_operator.autoscale_signals import FleetSignals, combine
from dwdp_operator.spec import Autoscaling
from dwdp_runtime.load.forward_model import mix_capacity
from dwdp_runtime.load.schema import NUM_BUCKETS, BucketLoad, ForwardCost, LoadReport, bucket_edge

POLICY = Autoscaling(minGroups=1, maxGroups=40, targetTTFTSeconds=2.0, scaleUpStabilizationSeconds=30,
                     scaleDownStabilizationSeconds=120, maxStep=10, intervalSeconds=5)
POOLED = QueueShape(ranks_per_group=4, ranks_per_queue=None)
PER_POD = QueueShape(ranks_per_group=4, ranks_per_queue=1)


def sig(offered: float, backlog: float = 0.0, *, forward: float = 0.75, ranks: int = 8) -> FleetSignals:
    return FleetSignals(pods=2, ranks=ranks, offered_load=offered, backlog_seconds=backlog, forward_seconds=forward)


def run(loads, *, current: int, policy=POLICY, shape=POOLED, dt: float = 5.0, t0: float = 0.0):
    """Apply the law tick by tick, following its own decisions; returns the decisions."""
    hist, out, t = ScaleHistory(), [], t0
    for s in loads:
        d = decide(s, hist, policy, shape, current=current, now=t)
        hist, current = d.history, d.desired
        out.append(d)
        t += dt
    return out


# -- the queue model ------------------------------------------------------------------------------------
def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)           # M/M/1: P(wait) = utilization
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)         # textbook value
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0.01, 300), st.floats(0.01, 300), st.floats(0.05, 5), st.floats(0.1, 2),
       st.sampled_from([None, 1, 2, 4, 8]))
def test_more_load_or_less_wait_never_needs_fewer_ranks(a, b, wait, service, per_queue):
    lo, hi = sorted((a, b))
    n_lo = servers_for(lo, wait_s=wait, service_s=service, miss=0.05, ranks_per_queue=per_queue)
    assert servers_for(hi, wait_s=wait, service_s=service, miss=0.05, ranks_per_queue=per_queue) >= n_lo
    assert servers_for(lo, wait_s=wait / 2, service_s=service, miss=0.05, ranks_per_queue=per_queue) >= n_lo
    assert n_lo >= lo / MAX_UTILIZATION - 1e-6
    if per_queue:
        assert n_lo % per_queue == 0
        assert wait_tail(per_queue, lo / (n_lo // per_queue), wait, service) <= 0.05
    else:
        assert wait_tail(n_lo, lo, wait, service) <= 0.05


@given(st.floats(0.1, 200), st.floats(0, 3), st.floats(0, 3), st.sampled_from([None, 1, 4]))
def test_more_variable_forwards_never_need_fewer_ranks(load, cv_a, cv_b, per_queue):
    """Allen-Cunneen: the wait grows with (1 + cv²); constant forwards (cv 0) are M/D/c."""
    lo, hi = sorted((cv_a, cv_b))
    assert servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05, ranks_per_queue=per_queue, cv=hi) >= \
        servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05, ranks_per_queue=per_queue, cv=lo)
    assert servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05, ranks_per_queue=per_queue, cv=0.0) == \
        servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05, ranks_per_queue=per_queue)


@given(st.floats(0.1, 200))
def test_one_pooled_queue_needs_no_more_ranks_than_a_queue_per_pod(load):
    pooled = servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05)
    assert pooled <= servers_for(load, wait_s=1.2, service_s=0.75, miss=0.05, ranks_per_queue=1)


# -- steps 1-3 ------------------------------------------------------------------------------------------
def test_wait_budget_is_ttft_less_a_forward_with_a_floor_and_the_queue_target_wins_when_smaller():
    assert wait_budget(POLICY, 0.75) == pytest.approx(1.25)
    assert wait_budget(POLICY, 1.9) == pytest.approx(0.5)   # a quarter of the target at least
    both = POLICY.model_copy(update={"targetQueueSeconds": 0.4})
    assert wait_budget(both, 0.75) == pytest.approx(0.4)


def test_correction_only_raises_and_only_with_enough_requests():
    base = sig(10.0)
    assert correction(FleetSignals(**{**base.__dict__, "correction": 1.5, "correction_weight": 5})) == 1.0
    assert correction(FleetSignals(**{**base.__dict__, "correction": 1.5,
                                      "correction_weight": CORRECTION_MIN_WEIGHT})) == 1.5
    assert correction(FleetSignals(**{**base.__dict__, "correction": 0.6, "correction_weight": 100})) == 1.0
    assert correction(FleetSignals(**{**base.__dict__, "correction": 9.0, "correction_weight": 100})) == 2.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 500), st.floats(0, 500), st.floats(0, 20_000), st.floats(0.05, 3))
def test_recommendations_grow_with_load_and_the_backlog_at_most_doubles_it(a, b, backlog, forward):
    lo, hi = sorted((a, b))
    burst_lo, up_lo, down_lo, load_lo, _ = recommend(sig(lo, backlog, forward=forward), POLICY, POOLED)
    burst_hi, up_hi, down_hi, _, _ = recommend(sig(hi, backlog, forward=forward), POLICY, POOLED)
    assert up_hi >= up_lo and down_hi >= down_lo and burst_hi >= burst_lo and burst_lo == up_lo
    assert lo <= load_lo <= 2 * lo + 1e-9
    assert load_lo == pytest.approx(lo + min(backlog / BACKLOG_HORIZON_S, lo))


# -- decide ---------------------------------------------------------------------------------------------
signals = st.builds(FleetSignals, pods=st.integers(0, 50), ranks=st.integers(0, 200),
                    offered_load=st.one_of(st.none(), st.floats(0, 1e4)),
                    backlog_seconds=st.one_of(st.none(), st.floats(0, 1e6)),
                    forward_seconds=st.one_of(st.none(), st.floats(0.001, 30)),
                    correction=st.one_of(st.none(), st.floats(0.01, 100)), correction_weight=st.floats(0, 1e4))


@settings(max_examples=300, deadline=None)
@given(st.lists(signals, min_size=1, max_size=12), st.integers(0, 60), st.integers(1, 20), st.integers(0, 30))
def test_desired_is_always_inside_the_bounds_and_moves_at_most_max_step(seq, current, lo, extra):
    policy = POLICY.model_copy(update={"minGroups": lo, "maxGroups": lo + extra, "maxStep": 3})
    for d in run(seq, current=current, policy=policy, dt=60.0):
        assert lo <= d.desired <= lo + extra
        inside = min(lo + extra, max(lo, d.current))
        assert d.reason == ScaleReason.BOUNDS or abs(d.desired - inside) <= 3


def test_no_measurement_holds_and_bounds_still_apply():
    d = decide(FleetSignals(), ScaleHistory(), POLICY, POOLED, current=3, now=0.0)
    assert (d.desired, d.reason) == (3, ScaleReason.NO_SIGNAL)
    d = decide(FleetSignals(), ScaleHistory(), POLICY, POOLED, current=60, now=0.0)
    assert (d.desired, d.reason) == (40, ScaleReason.BOUNDS)


def test_a_burst_panics_up_at_once_and_holds_against_a_quick_dip():
    decisions = run([sig(6.0)] * 10 + [sig(60.0, 500.0)] + [sig(6.0)] * 6, current=2)
    burst = decisions[10]
    assert burst.reason == ScaleReason.PANIC and burst.desired > 2 * burst.current
    after = decisions[11:]
    assert all(d.desired >= d.current for d in after)  # no scale-down within the panic hold (30 s here < 60 s)
    assert 6 * 5.0 < PANIC_HOLD_S


def test_the_panic_hold_is_the_policy_s():
    """``panicHoldSeconds`` (default PANIC_HOLD_S) bounds how long a burst blocks the scale-down: with a short down
    window the fleet comes down just after the hold, a shorter hold brings it down sooner."""
    def first_down(hold):
        policy = POLICY.model_copy(update={"scaleDownStabilizationSeconds": 10, "panicHoldSeconds": hold})
        decisions = run([sig(6.0)] * 10 + [sig(60.0, 500.0)] + [sig(4.0)] * 40, current=2, policy=policy)
        assert decisions[10].reason == ScaleReason.PANIC
        held = [d for d in decisions[11:] if d.reason == ScaleReason.STABILIZING and "burst" in d.message]
        return next(i for i, d in enumerate(decisions) if i > 10 and d.desired < d.current), len(held)

    assert Autoscaling(maxGroups=4).panicHoldSeconds == PANIC_HOLD_S
    late, held_late = first_down(PANIC_HOLD_S)
    soon, held_soon = first_down(10)
    assert (late - 10) * 5.0 >= PANIC_HOLD_S and held_late > 0
    assert soon < late and held_soon < held_late


def test_a_moderate_rise_scales_up_only_after_the_up_window():
    rise = recommend(sig(12.0), POLICY, POOLED)[1]
    decisions = run([sig(7.0)] * 4 + [sig(12.0)] * 30, current=3)
    assert rise > 3 and rise < 2 * 3  # not a panic
    first_up = next(i for i, d in enumerate(decisions) if d.desired > d.current)
    assert decisions[first_up].reason == ScaleReason.SCALE_UP
    assert (first_up - 4) * 5.0 >= POLICY.scaleUpStabilizationSeconds
    assert all(d.reason in (ScaleReason.STABILIZING, ScaleReason.HOLD) for d in decisions[4:first_up])


def test_scale_down_waits_for_the_window_with_margin_and_goes_by_max_step():
    high = recommend(sig(80.0), POLICY, POOLED)[1]
    decisions = run([sig(80.0)] * 70 + [sig(4.0)] * 80, current=high)
    downs = [i for i, d in enumerate(decisions) if d.desired < d.current]
    assert downs and (downs[0] - 70) * 5.0 >= POLICY.scaleDownStabilizationSeconds
    assert all(decisions[i].reason == ScaleReason.SCALE_DOWN for i in downs)
    assert all(decisions[i].current - decisions[i].desired <= POLICY.maxStep for i in downs)
    end = decisions[-1].desired
    assert end == recommend(sig(4.0), POLICY, POOLED)[2]


def test_a_brief_dip_does_not_scale_down():
    dip = int(POLICY.scaleDownStabilizationSeconds / 5) - 4  # almost the down window, in ticks
    decisions = run([sig(40.0)] * 70 + [sig(5.0)] * dip + [sig(40.0)] * 20,
                    current=recommend(sig(40.0), POLICY, POOLED)[1])
    assert all(d.desired >= d.current for d in decisions)


def test_a_fresh_history_never_scales_down_before_it_covers_the_window():
    """After an operator restart: the down window must be seen again."""
    decisions = run([sig(2.0)] * int(POLICY.scaleDownStabilizationSeconds / 5), current=10)
    assert all(d.desired == 10 for d in decisions)
    assert decisions[-1].reason == ScaleReason.STABILIZING


def test_steady_noise_inside_the_margin_never_moves_the_fleet():
    import random
    rng = random.Random(3)
    loads = [sig(30.0 * (1 + rng.uniform(-0.03, 0.03))) for _ in range(720)]  # an hour of ticks at +-3 %
    start = recommend(sig(30.0), POLICY, POOLED)[1]
    decisions = run(loads, current=start)
    assert sum(1 for d in decisions if d.changed) <= 1


def test_a_random_router_needs_at_least_as_many_groups_as_an_endpoint_picker():
    for load in (1.0, 10.0, 60.0):
        assert recommend(sig(load), POLICY, PER_POD)[1] >= recommend(sig(load), POLICY, POOLED)[1]


def test_decision_status_is_the_crd_shape():
    d = run([sig(20.0, 100.0)], current=2)[0]
    st_ = d.status()
    assert st_["desiredGroups"] == d.desired and st_["reason"] == str(d.reason)
    assert set(st_["signals"]) == {"pods", "ranks", "offeredLoad", "backlogSeconds", "drainSeconds", "forwardSeconds",
                                   "ttftEstimateSeconds", "ttftObservedSeconds", "ttftCorrection", "waitingTokens",
                                   "runningTokens", "saturation"}


# -- the fleet's signals --------------------------------------------------------------------------------
def _report(*, floor: float, weight: float, arrivals: float, waiting: int = 0, ready=True, draining=False,
            bucket: int = 2, ranks: int = 4, forward: float = 0.75) -> LoadReport:
    buckets = [BucketLoad(isl_le=bucket_edge(i)) for i in range(NUM_BUCKETS)]
    buckets[bucket] = BucketLoad(isl_le=bucket_edge(bucket), arrival_tokens_per_second=arrivals, waiting_tokens=waiting)
    cost = ForwardCost(floor_seconds=floor, max_tokens=1e9, max_pairs=1e18, weight=weight)
    return LoadReport(ready=ready, draining=draining, ranks=ranks, max_num_tokens=16384, buckets=buckets,
                      forward_cost=cost, forward_seconds=forward, waiting_prefill_tokens=waiting)


def test_combine_weighs_the_pods_models_by_their_forwards_and_skips_draining_and_starting_pods():
    old = _report(floor=0.7, weight=300.0, arrivals=40_000)
    young = _report(floor=3.0, weight=3.0, arrivals=40_000)   # a new pod's slow first forwards
    s = combine([old, young, _report(floor=0.01, weight=1e6, arrivals=1e9, draining=True),
                 _report(floor=0.01, weight=1e6, arrivals=1e9, ready=False)])
    assert s.pods == 2 and s.ranks == 8
    mix = [0.0] * NUM_BUCKETS
    mix[2] = 80_000.0
    fleet = ForwardCost(floor_seconds=(0.7 * 300 + 3.0 * 3) / 303, max_tokens=1e9, max_pairs=1e18, weight=303)
    assert s.offered_load == pytest.approx(80_000 / mix_capacity(fleet, mix, 16384))
    plain = ForwardCost(floor_seconds=(0.7 + 3.0) / 2, max_tokens=1e9, max_pairs=1e18, weight=1)
    assert s.offered_load < 0.5 * 80_000 / mix_capacity(plain, mix, 16384)


def test_combine_without_measurement_is_no_signal():
    assert combine([]).offered_load is None
    assert combine([LoadReport(ready=True, ranks=2)]).offered_load is None
    assert decide(combine([]), ScaleHistory(), POLICY, POOLED, current=2, now=0.0).reason == ScaleReason.NO_SIGNAL


def test_drain_and_ttft_estimate_of_the_fleet():
    s = combine([_report(floor=0.5, weight=100.0, arrivals=10_000, waiting=40_000)])
    assert s.drain_seconds == pytest.approx(s.backlog_seconds / 4)
    assert s.ttft_estimate_seconds == pytest.approx(s.drain_seconds + 0.75)
    assert math.isclose(s.summary()["drainSeconds"], s.drain_seconds, rel_tol=1e-2)
