"""Fleet simulator: the operator's autoscaling law on a discrete-event model of N DWDP groups, against an
oracle that knows the future. Reports only (docs/OPERATOR.md, "Autoscaling", holds the measured table).

    python bench/fleet_sim.py                          # every trace, the defaults below
    python bench/fleet_sim.py --trace burst --router random --startup-s 120

Per trace it prints: SLO attainment (share of requests with TTFT <= --target-ttft), the oracle's, group-hours
and their ratio to the oracle's, scale changes per simulated hour, the largest fleet, TTFT percentiles, and
the *feasible* share: requests whose own forward alone fits the target (a 64K prompt's prefill alone takes
longer than 2 s on one rank: no fleet size serves it in time).

The law is ``dwdp_operator.autoscale.decide`` itself, fed with the worker's own ``LoadEstimator`` reports
(``fleet_model``). The **oracle** knows the trace: for every ``--window-s`` window it runs the window's
requests (with ``--warm-s`` seconds before it) on a fixed fleet and keeps the fewest groups that serve the
window at the target share (95 % of the window's feasible requests); its groups are Ready exactly when
needed, and it pays ``--startup-s`` of group time for each group it adds (it starts them that much earlier).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.fleet_model import Fleet, FleetConfig, MeasuredCost, RooflineCost  # noqa: E402
from bench.fleet_traces import TRACES, Trace, arrivals  # noqa: E402
from dwdp_operator.spec import Autoscaling  # noqa: E402

ATTAINMENT_GOAL = 0.95   # the goal: 95 % of requests within the TTFT target


def base_rate(trace: Trace, cfg: FleetConfig, cost, base_groups: float) -> float:
    """Requests/s of ``base_groups`` groups' full-forward capacity at the trace's mean prompt length."""
    mean = trace.mean_isl
    per_forward = max(1, int(cfg.max_num_tokens // mean))
    tokens_per_s = per_forward * mean / cost.forward_s([int(mean)] * per_forward)
    return base_groups * cfg.ranks_per_group * tokens_per_s / mean


def attainment(ttft: list[float], target: float) -> float:
    return sum(1 for x in ttft if x <= target) / len(ttft) if ttft else 1.0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def feasible(reqs: list[tuple[float, int]], cost, target: float) -> list[bool]:
    """Per request: its prompt's forward alone takes at most the target (else no fleet serves it in time)."""
    fits: dict[int, bool] = {}
    return [fits.setdefault(n, cost.forward_s([n]) <= target) for _, n in reqs]


def oracle(reqs: list[tuple[float, int]], cfg: FleetConfig, cost, *, duration_s: float, target: float,
           window_s: float, warm_s: float, max_groups: int, min_groups: int, seed: int) -> dict:
    """The fewest groups per window that meet the goal, searched from the previous window's count."""
    warm = FleetConfig(**{**cfg.__dict__, "first_pass_factor": 1.0})  # its groups are warmed before they are needed
    counts, within, total = [], 0, 0
    n, start = min_groups, 0
    w0 = 0.0
    while w0 < duration_s:
        w1 = min(duration_s, w0 + window_s)
        while start < len(reqs) and reqs[start][0] < w0 - warm_s:
            start += 1
        stop = start
        while stop < len(reqs) and reqs[stop][0] < w1:
            stop += 1
        window = reqs[start:stop]
        counted = [fit for (t, _), fit in zip(window, feasible(window, cost, target)) if t >= w0]
        goal = ATTAINMENT_GOAL * (sum(counted) / len(counted) if counted else 1.0)

        def run(groups: int) -> list[float]:
            fleet = Fleet(warm, cost, policy=None, groups=groups, seed=seed, estimators=False, end_s=w1)
            return fleet.run(window, count_from=w0).ttft

        results: dict[int, list[float]] = {}

        def ok(groups: int) -> bool:
            results[groups] = run(groups)
            return attainment(results[groups], target) >= goal

        if ok(n):
            while n > min_groups and ok(n - 1):
                n -= 1
        else:
            while n < max_groups and not ok(n + 1):
                n += 1
            n = min(max_groups, n + 1)
            if n not in results:
                results[n] = run(n)
        counts.append(n)
        ttft = results[n]
        within += sum(1 for x in ttft if x <= target)
        total += len(ttft)
        w0 = w1
    seconds = sum(c * window_s for c in counts) + cfg.startup_s * sum(max(0, b - a) for a, b in zip([0] + counts, counts))
    return {"group_hours": seconds / 3600, "attainment": within / total if total else 1.0, "max_groups": max(counts),
            "counts": counts}


def simulate(name: str, args, cfg: FleetConfig, cost, policy: Autoscaling) -> dict:
    trace = TRACES[name]
    duration = trace.duration_s * args.scale
    rps = base_rate(trace, cfg, cost, args.base_groups)
    reqs = arrivals(trace, rps, seed=args.seed, duration_s=duration)
    start_groups = max(policy.minGroups, math.ceil(args.base_groups * trace.rate(0.0)))
    t0 = time.perf_counter()
    fleet = Fleet(cfg, cost, policy=policy, groups=start_groups, seed=args.seed, end_s=duration)
    res = fleet.run(reqs)
    sim_s = time.perf_counter() - t0
    hours = duration / 3600
    out = {"trace": name, "requests": len(reqs), "base_rps": round(rps, 2), "hours": round(hours, 3),
           "attainment": attainment(res.ttft, args.target_ttft), "group_hours": res.group_seconds / 3600,
           "changes_per_hour": len(res.changes) / hours, "max_groups": max([c[2] for c in res.changes] + [start_groups]),
           "ttft_p50": percentile(res.ttft, 0.5), "ttft_p95": percentile(res.ttft, 0.95),
           "ttft_p99": percentile(res.ttft, 0.99), "sim_seconds": round(sim_s, 1),
           "feasible": sum(feasible(reqs, cost, args.target_ttft)) / max(1, len(reqs)),
           "reasons": sorted({c[3] for c in res.changes})}
    if not args.no_oracle:
        orc = oracle(reqs, cfg, cost, duration_s=duration, target=args.target_ttft, window_s=args.window_s,
                     warm_s=args.warm_s, max_groups=policy.maxGroups, min_groups=policy.minGroups, seed=args.seed)
        out.update(oracle_attainment=orc["attainment"], oracle_group_hours=orc["group_hours"],
                   oracle_max_groups=orc["max_groups"], group_hours_ratio=out["group_hours"] / orc["group_hours"])
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleet_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", choices=sorted(TRACES), help="repeatable; default: all")
    p.add_argument("--model", default="qwen3-235b-a22b")
    p.add_argument("--dtype", default="fp8")
    p.add_argument("--hardware", default="h200-hgx")
    p.add_argument("--dwdp-size", type=int, default=4)
    p.add_argument("--gpus-per-pod", type=int, default=4, help="ranks per pod (HGX: = dwdp-size, one pod per group)")
    p.add_argument("--cost", choices=["roofline", "measured"], default="roofline")
    p.add_argument("--tokens-per-second", type=float, default=20000.0, help="--cost measured: per rank")
    p.add_argument("--floor-s", type=float, default=0.7, help="--cost measured: the shortest forward")
    p.add_argument("--max-num-tokens", type=int, default=16384)
    p.add_argument("--router", choices=["pooled", "random"], default="pooled",
                   help="pooled: an endpoint picker (spec.inferencePool); random: a plain Service")
    p.add_argument("--target-ttft", type=float, default=2.0)
    p.add_argument("--startup-s", type=float, default=60.0, help="asked for -> Ready (scheduling, weights, warm-up)")
    p.add_argument("--first-pass-factor", type=float, default=3.0, help="cost of a rank's first forward per ISL bucket")
    p.add_argument("--base-groups", type=float, default=1.5, help="the base load, in groups at full forwards")
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--max-groups", type=int, default=40)
    p.add_argument("--up-window", type=float, default=30.0)
    p.add_argument("--down-window", type=float, default=120.0)
    p.add_argument("--max-step", type=int, default=10)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=60.0, help="the oracle's decision window")
    p.add_argument("--warm-s", type=float, default=20.0, help="requests before a window the oracle replays")
    p.add_argument("--scale", type=float, default=1.0, help="trace duration multiplier (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-oracle", action="store_true")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.dwdp_size % args.gpus_per_pod:
        print("fleet_sim: error: --gpus-per-pod must divide --dwdp-size", file=sys.stderr)
        return 2
    cfg = FleetConfig(ranks_per_pod=args.gpus_per_pod, pods_per_group=args.dwdp_size // args.gpus_per_pod,
                      max_num_tokens=args.max_num_tokens if "isl-mix" not in (args.trace or []) else 65536,
                      startup_s=args.startup_s, first_pass_factor=args.first_pass_factor, router=args.router)
    cost = (RooflineCost(model=args.model, dtype=args.dtype, hardware=args.hardware, dwdp_size=args.dwdp_size)
            if args.cost == "roofline" else MeasuredCost(args.tokens_per_second, args.floor_s))
    policy = Autoscaling(minGroups=args.min_groups, maxGroups=args.max_groups, targetTTFTSeconds=args.target_ttft,
                         scaleUpStabilizationSeconds=args.up_window, scaleDownStabilizationSeconds=args.down_window,
                         maxStep=args.max_step, intervalSeconds=args.interval)
    print(f"cost: {cost.name}; router {args.router}; {cfg.ranks_per_group} ranks/group in {cfg.pods_per_group} pod(s); "
          f"max_num_tokens {cfg.max_num_tokens}; startup {args.startup_s:g}s; first pass x{args.first_pass_factor:g}; "
          f"target TTFT {args.target_ttft:g}s; windows up {args.up_window:g}s / down {args.down_window:g}s; "
          f"tick {args.interval:g}s; base load {args.base_groups:g} groups")
    results = []
    for name in args.trace or list(TRACES):
        trace_cfg = cfg if name != "isl-mix" else FleetConfig(**{**cfg.__dict__, "max_num_tokens": 65536})
        r = simulate(name, args, trace_cfg, cost, policy)
        results.append(r)
        line = (f"{name:11s} {r['requests']:8d} req  attainment {r['attainment']:.3f}"
                f"{'' if r['feasible'] > 0.999 else ' of feasible %.3f' % r['feasible']}"
                f"{'' if args.no_oracle else ' (oracle %.3f)' % r['oracle_attainment']}  group-h {r['group_hours']:.2f}"
                f"{'' if args.no_oracle else ' / oracle %.2f = %.2fx' % (r['oracle_group_hours'], r['group_hours_ratio'])}"
                f"  changes/h {r['changes_per_hour']:.1f}  max groups {r['max_groups']}"
                f"{'' if args.no_oracle else ' (oracle %d)' % r['oracle_max_groups']}"
                f"  TTFT p50/p95/p99 {r['ttft_p50']:.2f}/{r['ttft_p95']:.2f}/{r['ttft_p99']:.2f}s  [{r['sim_seconds']}s]")
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
