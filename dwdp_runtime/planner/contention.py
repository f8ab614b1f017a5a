"""Source contention of asynchronous peer pulls, and the time to move a traffic matrix.

Pure math. The DWDP paper's model (seed article, "对抗源端多对一竞争"): in a group of ``N`` ranks,
each rank pulls from the other ``N-1`` one peer at a time. When a tagged rank picks a source, each
of the other ``N-2`` ranks picks the same source with probability ``1/(N-1)``, so the number of
contenders is ``X ~ Binomial(N-2, 1/(N-1))`` and the contention level (including itself) is
``C = X + 1``. N = 3 → P(C=1) = 0.5 (the paper's number).

The paper computes only probabilities. The planner adds one assumption to turn it into time: a
pull whose source is shared by ``C`` pullers gets ``1/C`` of the source's port for its whole
duration, so serial (one peer at a time) pulls take ``E[C]`` times the uncontended time, with
``E[C] = 1 + (N-2)/(N-1)``.

Round-robin slicing (``contention_opt``: 2 MiB slices interleaved across peers) spreads every
rank's demand over all sources at once; in the fluid limit this is the preemptive open-shop
schedule, whose makespan is the largest load of any port:
``T = max(max_dst Σ_src bytes, max_src Σ_dst bytes) / BW`` (each GPU port sends and receives
``BW`` per direction at the same time on an NVSwitch system).
"""

from __future__ import annotations

import math


def binomial_pmf(n: int, p: float, x: int) -> float:
    if x < 0 or x > n:
        return 0.0
    return math.comb(n, x) * p ** x * (1.0 - p) ** (n - x)


def contention_pmf(num_ranks: int) -> dict[int, float]:
    """``{c: P(C = c)}`` for c = 1..N-1 in a group of ``num_ranks`` (N >= 2)."""
    if num_ranks < 2:
        raise ValueError(f"num_ranks={num_ranks}: contention needs >= 2 ranks")
    n, p = num_ranks - 2, 1.0 / (num_ranks - 1)
    return {x + 1: binomial_pmf(n, p, x) for x in range(n + 1)}


def expected_contention(num_ranks: int) -> float:
    """``E[C] = 1 + (N-2)/(N-1)`` (mean of the Binomial plus the tagged rank)."""
    return sum(c * pr for c, pr in contention_pmf(num_ranks).items())


def open_shop_makespan(matrix: list[list[float]], bandwidth: float) -> float:
    """Fluid makespan of moving ``matrix[dst][src]`` bytes when every port moves ``bandwidth``
    bytes/s each way: the busiest port's load / bandwidth."""
    if not matrix:
        return 0.0
    rows = [sum(r) for r in matrix]
    cols = [sum(r[j] for r in matrix) for j in range(len(matrix[0]))]
    return max(max(rows), max(cols)) / bandwidth


def serial_pull_time(ingress_bytes: float, bandwidth: float, num_ranks: int) -> float:
    """One rank pulling ``ingress_bytes`` one peer at a time, with the expected source contention."""
    return ingress_bytes / bandwidth * expected_contention(num_ranks)
