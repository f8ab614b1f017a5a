"""bench/fleet_sim.py's mechanics on a few simulated minutes (CPU): every request is answered, no faster than a
forward, the operator's own law scales the fleet up under a step and back down, the oracle meets its goal
with the fewest groups. The timing goal itself (attainment, group-hours vs the oracle) is the bench's to
report, not this test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench import fleet_sim  # noqa: E402
from bench.fleet_model import Fleet, FleetConfig, MeasuredCost, RooflineCost  # noqa: E402
from bench.fleet_traces import TRACES, Trace, arrivals  # noqa: E402
from dwdp_operator.spec import Autoscaling  # noqa: E402

COST = MeasuredCost(tokens_per_second=20_000.0, floor_s=0.5)
CFG = FleetConfig(ranks_per_pod=2, pods_per_group=1, max_num_tokens=16384, startup_s=10.0, first_pass_factor=3.0,
                  router="pooled")
POLICY = Autoscaling(minGroups=1, maxGroups=12, targetTTFTSeconds=2.0, scaleUpStabilizationSeconds=10,
                     scaleDownStabilizationSeconds=30, intervalSeconds=5)
STEP = Trace("step", 400.0, lambda t: 1.0 if t < 60 or t >= 150 else 6.0, 6.0)
BASE_GROUPS = 0.3   # 30 % of a group's full-forward load: one group carries the base, the step (6x) needs more


def _run(trace: Trace, *, groups: int = 1, policy=POLICY, seed: int = 1):
    rps = fleet_sim.base_rate(trace, CFG, COST, BASE_GROUPS)
    reqs = arrivals(trace, rps, seed=seed)
    fleet = Fleet(CFG, COST, policy=policy, groups=groups, seed=seed, end_s=trace.duration_s)
    return reqs, fleet, fleet.run(reqs)


def test_every_request_is_answered_no_faster_than_a_forward():
    reqs, _, res = _run(STEP)
    assert len(res.ttft) == len(reqs) > 500
    assert min(res.ttft) >= COST.floor_s - 1e-9
    assert sorted(res.arrival) == sorted(t for t, _ in reqs)


def test_the_operators_law_scales_up_under_a_step_and_back_down():
    _, fleet, res = _run(STEP)
    ups = [c for c in res.changes if c[2] > c[1]]
    downs = [c for c in res.changes if c[2] < c[1]]
    assert ups and ups[0][0] >= 60 and {c[3] for c in ups} <= {"PanicScaleUp", "ScaleUp"}
    assert downs and downs[-1][0] > 150 and {c[3] for c in downs} == {"ScaleDown"}
    assert max(c[2] for c in res.changes) > 1
    assert fleet.lead_s == pytest.approx(CFG.startup_s)  # the start-up the law sized bursts for, measured
    # group-seconds: at least one group all along, at most every group ever created all along
    assert STEP.duration_s <= res.group_seconds <= len(fleet.groups) * STEP.duration_s
    removed = [g for g in fleet.groups if g.removed is not None]
    assert removed and all(not p.queue and not any(r.batch for r in p.ranks) for g in removed for p in g.pods)


def test_a_fixed_fleet_without_policy_never_changes():
    _, fleet, res = _run(STEP, groups=3, policy=None)
    assert res.changes == [] and len(fleet.groups) == 3
    assert res.group_seconds == pytest.approx(3 * STEP.duration_s)


def test_the_oracle_meets_the_goal_with_the_fewest_groups_per_window():
    flat = Trace("flat", 180.0, lambda t: 2.0, 2.0)
    reqs = arrivals(flat, fleet_sim.base_rate(flat, CFG, COST, 1.0), seed=2)
    orc = fleet_sim.oracle(reqs, CFG, COST, duration_s=flat.duration_s, target=2.0, window_s=60.0, warm_s=20.0,
                           max_groups=12, min_groups=1, seed=2)
    assert orc["attainment"] >= fleet_sim.ATTAINMENT_GOAL
    n = orc["counts"][-1]
    assert n >= 2  # twice one group's full-forward load cannot fit one group
    fewer = Fleet(FleetConfig(**{**CFG.__dict__, "first_pass_factor": 1.0}), COST, policy=None, groups=n - 1,
                  estimators=False, end_s=180.0).run([r for r in reqs if r[0] >= 100.0], count_from=120.0)
    assert fleet_sim.attainment(fewer.ttft, 2.0) < fleet_sim.ATTAINMENT_GOAL


def test_traces_have_their_shapes():
    burst = TRACES["burst"]
    assert burst.rate(0) == 1.0 and burst.rate(30 * 60) == 10.0 and burst.rate(83 * 60) == 1.0
    reqs = arrivals(TRACES["isl-mix"], 5.0, seed=0, duration_s=600.0)
    assert min(n for _, n in reqs) >= 1024 and max(n for _, n in reqs) <= 65536
    assert abs(len(reqs) / 600.0 - 5.0) < 0.6


def test_roofline_cost_comes_from_the_planner():
    cost = RooflineCost(model="qwen3-235b-a22b", dtype="fp8", hardware="h200-hgx", dwdp_size=4)
    one, packed = cost.forward_s([2048]), cost.forward_s([2048] * 8)
    assert packed == pytest.approx(one, rel=0.05)  # prefetch-bound: packing is (nearly) free
    assert cost.forward_s([65536]) > 3 * cost.forward_s([16384])  # attention grows with the square


def test_the_cli_runs_a_short_trace(capsys):
    assert fleet_sim.main(["--trace", "steady", "--scale", "0.02", "--no-oracle", "--cost", "measured"]) == 0
    out = capsys.readouterr().out
    assert "steady" in out and "attainment" in out
