"""Exponentially decayed sums: the memory of every load signal (pure; ``now`` is always an argument).

A ``Decayed`` sum holds ``S(t) = Σ x_i · 2^(-(t - t_i)/h)`` for samples ``x_i`` added at ``t_i`` with
half-life ``h``. Invariants:
  * ``value(now)`` never increases between samples and never goes below 0 for non-negative samples;
    time going backwards (a caller's clock step) decays nothing (``dt`` is clamped at 0).
  * ``rate(now)`` is the samples' rate per second: ``S / ∫ kernel``, where the kernel's integral runs
    from the sum's creation (``since``) to ``now`` — so a sum only ``t`` seconds old is not biased low
    by the window it has not seen yet (a new worker's arrival rate is right from its first seconds).
  * The ratio of two sums decayed with the same half-life (throughput = tokens / seconds) does not move
    while no sample arrives: an idle worker keeps its last measurement, new samples outweigh it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LN2 = math.log(2.0)


@dataclass
class Decayed:
    half_life_s: float
    since: float          # when the sum started (the rate's window begins here)
    total: float = 0.0
    at: float | None = None

    def __post_init__(self) -> None:
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")

    def _factor(self, now: float) -> float:
        if self.at is None:
            return 1.0
        return 2.0 ** (-max(0.0, now - self.at) / self.half_life_s)

    def add(self, x: float, now: float) -> None:
        self.total = self.total * self._factor(now) + x
        self.at = now if self.at is None else max(self.at, now)

    def value(self, now: float) -> float:
        return self.total * self._factor(now)

    def window_s(self, now: float) -> float:
        """∫ 2^(-u/h) du over [since, now]: the seconds of history the sum has seen, decay-weighted."""
        age = max(0.0, now - self.since)
        return self.half_life_s / LN2 * (1.0 - 2.0 ** (-age / self.half_life_s))

    def rate(self, now: float) -> float:
        window = self.window_s(now)
        return self.value(now) / window if window > 0 else 0.0


def ratio(num: Decayed, den: Decayed, now: float) -> float | None:
    """``num / den`` of two sums with the same half-life; None while the denominator is empty."""
    d = den.value(now)
    return num.value(now) / d if d > 0 else None

