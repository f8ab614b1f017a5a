"""A measured roofline of one front's forwards: seconds = max(floor, a·tokens + b·pairs) (pure; ``now`` is an
argument), and the prefill capacity it gives a mix of prompt lengths under FIFO packing.

Why this shape: the planner's DWDP forward (docs/PLANNER.md) is the longer of the expert prefetch, which
does not depend on the batch (a *floor*: every forward pulls the peers' experts), and the compute, which
is linear in tokens (GEMMs) plus linear in attention pairs Σ l² (quadratic in each prompt's length). So a
lone 2K prompt and a packed 16K-token forward can take the same time, and per-token cost depends on how
the queue packs — a tokens/s measured on small forwards is not the capacity under load.

  * ``floor`` = the smallest forward time of the last ``FLOOR_WINDOWS`` windows of ``FLOOR_WINDOW_S``
    (it follows the hardware within ten minutes, never one slow forward);
  * ``a, b`` = decayed least squares of the forwards *above* the floor (``COMPUTE_BOUND`` × floor),
    without intercept and never negative (a degenerate pair falls back to the better one-term fit);
  * without a forward above the floor, forwards larger than any seen (tokens or pairs) are charged
    proportionally more than the floor (the conservative reading: nothing says they are free).

``mix_capacity``: tokens/s of one rank when FIFO packing (the worker's ``batcher.pack``) fills forwards of
``max_num_tokens`` from a long queue of the mix: ``PACKING_DRAWS`` prompts drawn deterministically (bucket by
the mix's share of requests, length log-uniform within a factor √2 of the bucket's measured mean, or across
the bucket without one), packed, each forward timed by the model.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

from .decay import Decayed
from .schema import ForwardCost, bucket_edge

FLOOR_WINDOW_S = 60.0
FLOOR_WINDOWS = 10
COMPUTE_BOUND = 1.1       # a forward 10 % above the floor is compute-bound: it says what tokens cost
FIT_HALF_LIFE_S = 300.0   # compute cost per token changes with the model and the kernels, not the load
PACKING_DRAWS = 256
RESIDUAL_TIE = 1e-9       # relative to Σ seconds²: residuals this close are equal (float rounding, not the data)
SPREAD = math.sqrt(2)     # prompts of a bucket are drawn within a factor √2 of their measured mean
_GOLDEN = (math.sqrt(5) - 1) / 2   # two independent low-discrepancy sequences (Weyl, irrational steps)
_SQRT2 = math.sqrt(2) - 1


@dataclass
class ForwardModelFit:
    start: float
    _floors: list[tuple[int, float]] = field(default_factory=list)   # (window index, min seconds)
    _sums: list[Decayed] = field(init=False)                          # TT, TP, PP, TF, PF, FF
    _count: Decayed = field(init=False)
    _max_tokens: float = 0.0
    _max_pairs: float = 0.0

    def __post_init__(self) -> None:
        self._sums = [Decayed(FIT_HALF_LIFE_S, self.start) for _ in range(6)]
        self._count = Decayed(FIT_HALF_LIFE_S, self.start)

    def add(self, lengths: Sequence[int], seconds: float, now: float) -> None:
        tokens, pairs = float(sum(lengths)), float(sum(n * n for n in lengths))
        if tokens <= 0 or not seconds > 0:
            return
        w = int((now - self.start) // FLOOR_WINDOW_S)
        if self._floors and self._floors[-1][0] == w:
            self._floors[-1] = (w, min(self._floors[-1][1], seconds))
        else:
            self._floors.append((w, seconds))
        self._floors = [f for f in self._floors if f[0] > w - FLOOR_WINDOWS]
        self._count.add(1.0, now)
        self._max_tokens, self._max_pairs = max(self._max_tokens, tokens), max(self._max_pairs, pairs)
        if seconds > COMPUTE_BOUND * self.floor():
            for s, v in zip(self._sums, (tokens * tokens, tokens * pairs, pairs * pairs, tokens * seconds,
                                         pairs * seconds, seconds * seconds)):
                s.add(v, now)

    def floor(self) -> float:
        return min(f[1] for f in self._floors) if self._floors else 0.0

    def cost(self, now: float) -> ForwardCost | None:
        if not self._floors:
            return None
        tt, tp, pp, tf, pf, ff = (s.value(now) for s in self._sums)
        a = b = 0.0
        fitted = tt > 0 and pp > 0
        if fitted:
            det = tt * pp - tp * tp
            if det > 1e-9 * tt * pp:
                a, b = (tf * pp - pf * tp) / det, (pf * tt - tf * tp) / det
            if det <= 1e-9 * tt * pp or a < 0 or b < 0:
                a, b = _one_term_fit(tt, pp, tf, pf, ff)
        return ForwardCost(floor_seconds=self.floor(), seconds_per_token=a, seconds_per_pair=b, compute_fitted=fitted,
                           max_tokens=max(self._max_tokens, 1.0), max_pairs=max(self._max_pairs, 1.0),
                           weight=self._count.value(now))


def _one_term_fit(tt: float, pp: float, tf: float, pf: float, ff: float) -> tuple[float, float]:
    """(a, 0) or (0, b): the one-term least squares with the smaller residual. Prompts of one length make
    tokens and pairs proportional, so both residuals are equal up to rounding — which moves with the decay
    factor of the moment; a tie within ``RESIDUAL_TIE`` keeps the per-token term, so a report read twice
    without a new forward gives the same figures."""
    a_only, b_only = tf / tt, pf / pp
    residual_a, residual_b = ff - a_only * tf, ff - b_only * pf
    if residual_b < residual_a - RESIDUAL_TIE * ff:
        return 0.0, b_only
    return a_only, 0.0


def bucket_range(index: int) -> tuple[float, float]:
    """A bucket's prompt lengths (lo, hi]; the first starts at half its edge, the open one ends at twice its start."""
    hi, lo = bucket_edge(index), bucket_edge(index - 1) if index > 0 else None
    if hi is None:
        return float(lo), 2.0 * lo
    return float(lo if lo is not None else hi / 2), float(hi)


def _mean_length(lo: float, hi: float) -> float:
    return (hi - lo) / math.log(hi / lo) if hi > lo else lo


def draw_range(index: int, mean: float | None) -> tuple[float, float]:
    """Where a bucket's prompts are drawn: around their measured mean (a factor √2 either way) inside the
    bucket, or the whole bucket without one."""
    lo, hi = bucket_range(index)
    if mean is None or mean <= 0:
        return lo, hi
    a, b = max(1.0, mean / SPREAD), mean * SPREAD
    a, b = max(a, min(lo, mean)), min(b, max(hi, mean))   # inside the bucket, unless the mean is not
    return (a, b) if b > a else (mean, mean * (1 + 1e-9))


def mix_capacity(cost: ForwardCost, tokens_by_bucket: Sequence[float], max_num_tokens: int,
                 mean_lengths: Sequence[float | None] | None = None) -> float | None:
    """One rank's tokens/s on this mix, FIFO-packed into forwards of ``max_num_tokens``; None for an empty mix.
    ``mean_lengths``: the measured mean prompt length per bucket (None: the bucket's log-uniform mean)."""
    ranges = [draw_range(i, None if mean_lengths is None else mean_lengths[i]) for i in range(len(tokens_by_bucket))]
    reqs = [t / _mean_length(lo, hi) for t, (lo, hi) in zip(tokens_by_bucket, ranges)]
    total = sum(reqs)
    if total <= 0:
        return None
    cum, acc = [], 0.0
    for r in reqs:
        acc += r / total
        cum.append(acc)
    seconds = carried = 0.0
    tokens = pairs = 0.0
    for i in range(PACKING_DRAWS):
        lo, hi = ranges[min(bisect_right(cum, (i * _GOLDEN) % 1.0), len(cum) - 1)]
        n = lo * (hi / lo) ** ((i * _SQRT2) % 1.0)
        if tokens and tokens + n > max_num_tokens:
            seconds += cost.seconds(tokens, pairs)
            carried += tokens
            tokens = pairs = 0.0
        tokens, pairs = tokens + n, pairs + n * n
    seconds += cost.seconds(tokens, pairs)
    return (carried + tokens) / seconds


def bucket_capacity(cost: ForwardCost, index: int, max_num_tokens: int, mean_length: float | None = None) -> float:
    """One rank's tokens/s on prompts of one bucket alone (the per-ISL rate of ``LoadReport.buckets``)."""
    mix = [0.0] * (index + 1)
    mix[index] = 1.0
    means = [None] * index + [mean_length]
    return mix_capacity(cost, mix, max_num_tokens, means) or 0.0


def combine_costs(costs: Sequence[ForwardCost]) -> ForwardCost | None:
    """The fleet's model: every parameter averaged by the forwards behind it (a young pod weighs little)."""
    costs = [c for c in costs if c.weight > 0]
    if not costs:
        return None
    w = sum(c.weight for c in costs)

    def avg(name: str) -> float:
        return sum(getattr(c, name) * c.weight for c in costs) / w

    fitted = [c for c in costs if c.compute_fitted]
    wf = sum(c.weight for c in fitted)
    return ForwardCost(floor_seconds=avg("floor_seconds"),
                       seconds_per_token=sum(c.seconds_per_token * c.weight for c in fitted) / wf if wf else 0.0,
                       seconds_per_pair=sum(c.seconds_per_pair * c.weight for c in fitted) / wf if wf else 0.0,
                       compute_fitted=bool(fitted), max_tokens=max(c.max_tokens for c in costs),
                       max_pairs=max(c.max_pairs for c in costs), weight=w)
