"""How many ranks a prefill load needs for its wait budget: Erlang C on the forward as the unit of work.

The fluid model (docs/OPERATOR.md, "Autoscaling"): a rank serves *forwards* of about ``service_s``
seconds, each packing up to ``max_num_tokens`` tokens; ``load`` rank-seconds of prefill arrive per
second, i.e. ``load`` erlangs. A request meets its wait budget ``wait_s`` if a rank takes it into a
forward within ``wait_s``. For ``c`` ranks behind one queue (M/M/c, Erlang C), ``P(wait > t) =
C(c, a) · exp(-(c - a) t / service_s)``. Forwards are not exponential: by the Allen-Cunneen
approximation the M/G/c wait is M/M/c's times ``(1 + cv²) / 2`` (cv: the forward times' coefficient of
variation), so the tail decays with ``2 / (1 + cv²) · (c - a) t / service_s`` — twice as fast for DWDP's
near-constant forwards (the prefetch floor: M/D/c), slower for a mix of 1K and 64K prompts. The fleet is
sized so that this probability is at most ``miss``.

Where requests queue:
  * ``pooled``: one queue over every rank (a gateway's endpoint picker sends each request to the least
    loaded pod: join-the-shortest-queue is close to one shared queue);
  * otherwise one queue per pod (a Service spreads requests at random): ``Q`` pods of
    ``ranks_per_queue`` ranks each get ``load / Q`` — far more headroom for the same budget.

Pure; ``servers_for`` is monotone: more load or a smaller budget never asks for fewer ranks.
"""

from __future__ import annotations

import math

#: never plan ranks busier than this: the signals are estimates, and a fleet at 100 % has no room for noise
MAX_UTILIZATION = 0.95
#: the most ranks (or queues) a search considers: far above any fleet (1024 groups × 72 ranks)
SEARCH_LIMIT = 1 << 17
#: the forward times' cv when nothing measured it: 0, DWDP's floor-bound forwards (M/D/c: a tail 2x M/M/c's)
DEFAULT_CV = 0.0


def tail_rate(cv: float | None) -> float:
    """Allen-Cunneen: M/G/c waits are M/M/c's times (1 + cv²)/2, so the tail decays 2/(1 + cv²) as fast."""
    c = DEFAULT_CV if cv is None else cv
    return 2.0 / (1.0 + c * c)


def erlang_c(servers: int, load: float) -> float:
    """P(an arrival waits) for ``servers`` servers and ``load`` erlangs (1.0 when load >= servers)."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0  # Erlang B by its stable recursion
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return servers * b / (servers - load * (1.0 - b))


def wait_tail(servers: int, load: float, wait_s: float, service_s: float, cv: float | None = None) -> float:
    """P(wait > wait_s) for one queue of ``servers`` ranks serving ``load`` erlangs of forwards."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    return erlang_c(servers, load) * math.exp(-tail_rate(cv) * (servers - load) * wait_s / service_s)


def servers_for(load: float, *, wait_s: float, service_s: float | None, miss: float,
                ranks_per_queue: int | None = None, cv: float | None = None) -> int:
    """Ranks needed for ``load`` erlangs so that P(wait > wait_s) <= miss.

    ``ranks_per_queue`` None: one pooled queue; else the answer is a whole number of queues of that
    many ranks, each given an equal share. Without a forward time (nothing measured) only the
    utilization bound applies."""
    if load <= 0:
        return 0
    floor_ranks = math.ceil(load / MAX_UTILIZATION - 1e-9)
    if service_s is None or service_s <= 0:
        return _round_up(floor_ranks, ranks_per_queue)
    if ranks_per_queue is None:
        return _pooled(load, wait_s, service_s, miss, floor_ranks, tail_rate(cv))
    q = max(1, math.ceil(floor_ranks / ranks_per_queue))
    while q < SEARCH_LIMIT and wait_tail(ranks_per_queue, load / q, wait_s, service_s, cv) > miss:
        q += 1
    return q * ranks_per_queue


def _pooled(load: float, wait_s: float, service_s: float, miss: float, at_least: int, rate: float) -> int:
    """The smallest pooled c >= at_least meeting the tail: Erlang B's recursion walked once (O(c))."""
    b = 1.0
    for c in range(1, SEARCH_LIMIT):
        b = load * b / (c + load * b)
        if c < at_least or c <= load:
            continue
        wait = c * b / (c - load * (1.0 - b))
        if wait * math.exp(-rate * (c - load) * wait_s / service_s) <= miss:
            return c
    return SEARCH_LIMIT


def _round_up(ranks: int, per_queue: int | None) -> int:
    if per_queue is None:
        return ranks
    return math.ceil(ranks / per_queue) * per_queue
