"""Request traces for ``bench/fleet_sim.py``: Poisson arrivals under a rate profile, prompt lengths drawn
log-uniformly in a range (pure, seeded).

A trace's rate is a multiple of the *base rate*, the load of ``base_groups`` groups running full forwards
(the simulator converts; see ``base_rate``), so traces are independent of the model and the hardware.

  steady      60 min at the base rate (Poisson noise only: the oscillation check)
  diurnal     240 min, one day compressed: 0.25x at the ends, 1x at the peak (a cosine)
  burst       84 min: 20 min at 1x, a 2-minute ramp to 10x, 40 min at 10x, 2-minute ramp down, 20 min at 1x
  burst-step  the same with 10-second ramps (a launch, a batch job switched on)
  isl-mix     60 min at the base rate, prompts 1K-64K tokens (the others: 2K-16K)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

MIN = 60.0


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]   # multiple of the base rate at time t
    peak: float                      # max of rate (for thinning)
    isl_lo: int = 2048
    isl_hi: int = 16384

    @property
    def mean_isl(self) -> float:
        """Mean of the log-uniform length distribution."""
        lo, hi = self.isl_lo, self.isl_hi
        return (hi - lo) / math.log(hi / lo) if hi > lo else float(lo)


def _burst(ramp_s: float) -> Callable[[float], float]:
    start, hold = 20 * MIN, 40 * MIN

    def rate(t: float) -> float:
        if t < start:
            return 1.0
        if t < start + ramp_s:
            return 1.0 + 9.0 * (t - start) / ramp_s
        if t < start + ramp_s + hold:
            return 10.0
        if t < start + 2 * ramp_s + hold:
            return 10.0 - 9.0 * (t - start - ramp_s - hold) / ramp_s
        return 1.0
    return rate


TRACES: dict[str, Trace] = {
    "steady": Trace("steady", 60 * MIN, lambda t: 1.0, 1.0),
    "diurnal": Trace("diurnal", 240 * MIN, lambda t: 0.25 + 0.75 * (1 - math.cos(2 * math.pi * t / (240 * MIN))) / 2,
                     1.0),
    "burst": Trace("burst", 84 * MIN, _burst(2 * MIN), 10.0),
    "burst-step": Trace("burst-step", (80 + 20 / 60) * MIN, _burst(10.0), 10.0),
    "isl-mix": Trace("isl-mix", 60 * MIN, lambda t: 1.0, 1.0, isl_lo=1024, isl_hi=65536),
}


def arrivals(trace: Trace, base_rps: float, *, seed: int, duration_s: float | None = None) -> list[tuple[float, int]]:
    """(time, prompt length) of every request, sorted: Poisson at ``base_rps × rate(t)`` by thinning."""
    rng = random.Random(seed)
    end = trace.duration_s if duration_s is None else duration_s
    lam = base_rps * trace.peak
    out, t = [], 0.0
    log_lo, log_hi = math.log(trace.isl_lo), math.log(trace.isl_hi)
    while True:
        t += rng.expovariate(lam)
        if t >= end:
            return out
        if rng.random() * trace.peak <= trace.rate(t):
            out.append((t, int(math.exp(rng.uniform(log_lo, log_hi)))))
