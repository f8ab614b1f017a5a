"""The fleet's prefill load from its pods' ``/v1/load`` reports (pure): one set of numbers the law reads.

Why the fleet recomputes the work instead of summing each pod's ``offered_load``: a pod's work figures use
its own measured forward model, and a new pod (a group that just became Ready) has few, maybe slow,
samples (Dynamo #12430: new workers' slow first passes inflate the count). Here the pods' measured
rooflines (``LoadReport.forward_cost``) are averaged **weighted by the forwards behind them**
(``forward_model.combine_costs``), so a young pod's few samples weigh little; the fleet's arrivals and
queue are then converted to rank-seconds with the capacity that one model gives the fleet's arrival mix
under FIFO packing (``forward_model.mix_capacity``).

Invariants: only ready, not draining pods count toward the load and the ranks (a draining group finishes
its own queue and takes no new work; a starting one has none); ``None`` means "nothing measured anywhere"
(the law then holds), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dwdp_runtime.load.estimator import RUNNING_REMAINING
from dwdp_runtime.load.forward_model import combine_costs, mix_capacity
from dwdp_runtime.load.schema import NUM_BUCKETS, LoadReport


@dataclass(frozen=True)
class FleetSignals:
    pods: int = 0                          # reports counted (ready, not draining)
    ranks: int = 0                         # their ready ranks
    offered_load: float | None = None      # rank-seconds of prefill arriving per second
    backlog_seconds: float | None = None   # rank-seconds waiting or running
    forward_seconds: float | None = None   # mean forward time, weighted by measurement
    forward_cv: float | None = None        # their coefficient of variation (the queue model's service variability)
    correction: float | None = None        # observed ÷ predicted TTFT, weighted by requests
    correction_weight: float = 0.0
    waiting_tokens: int = 0
    running_tokens: int = 0
    saturation: float = 0.0                # mean over the pods
    ttft_observed_seconds: float | None = None

    @property
    def drain_seconds(self) -> float | None:
        if self.backlog_seconds is None or self.ranks <= 0:
            return None
        return self.backlog_seconds / self.ranks

    @property
    def ttft_estimate_seconds(self) -> float | None:
        """A new request's TTFT on the fleet now: drain the shared queue, then a forward."""
        drain = self.drain_seconds
        return None if drain is None else drain + (self.forward_seconds or 0.0)

    def summary(self) -> dict[str, float | int | None]:
        """The values shown in status and Events (rounded: a status write per decimal wiggle is waste)."""
        def r(x: float | None) -> float | None:
            return None if x is None else float(f"{x:.3g}")
        return {"pods": self.pods, "ranks": self.ranks, "offeredLoad": r(self.offered_load),
                "backlogSeconds": r(self.backlog_seconds), "drainSeconds": r(self.drain_seconds),
                "forwardSeconds": r(self.forward_seconds), "ttftEstimateSeconds": r(self.ttft_estimate_seconds),
                "ttftObservedSeconds": r(self.ttft_observed_seconds), "ttftCorrection": r(self.correction),
                "waitingTokens": self.waiting_tokens, "runningTokens": self.running_tokens,
                "saturation": r(self.saturation)}


def combine(reports: Iterable[LoadReport]) -> FleetSignals:
    serving = [r for r in reports if r.ready and not r.draining]
    if not serving:
        return FleetSignals()
    arrivals, queued = [0.0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS
    length_w, length_n = [0.0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS  # mean length per bucket, weighted by arrivals
    for r in serving:
        for i, b in enumerate(r.buckets[:NUM_BUCKETS]):
            arrivals[i] += b.arrival_tokens_per_second
            queued[i] += b.waiting_tokens + RUNNING_REMAINING * b.running_tokens
            if b.mean_length:
                w = b.arrival_tokens_per_second or 1e-9
                length_w[i] += b.mean_length * w
                length_n[i] += w
    means = [lw / n if n > 0 else None for lw, n in zip(length_w, length_n)]
    cost = combine_costs([r.forward_cost for r in serving if r.forward_cost is not None])
    budgets = [r.max_num_tokens for r in serving if r.max_num_tokens]
    capacity = None
    if cost is not None and budgets:
        capacity = mix_capacity(cost, arrivals if any(arrivals) else queued, min(budgets), means)
        if capacity is None:  # nothing arrives and nothing waits: no load to size, yet measured
            capacity = mix_capacity(cost, [1.0] + [0.0] * (NUM_BUCKETS - 1), min(budgets))
    fwd = _weighted((r.forward_seconds, r.forward_cost.weight if r.forward_cost else 0.0) for r in serving)
    cv = _weighted((r.forward_cv, r.forward_cost.weight if r.forward_cost else 0.0) for r in serving)
    corr = _weighted((r.ttft_correction, r.ttft_correction_weight) for r in serving)
    ttft = _weighted((r.ttft_observed_seconds, r.ttft_correction_weight or 1.0) for r in serving)
    return FleetSignals(
        pods=len(serving), ranks=sum(r.ranks for r in serving),
        offered_load=None if capacity is None else sum(arrivals) / capacity,
        backlog_seconds=None if capacity is None else sum(queued) / capacity, forward_seconds=fwd, forward_cv=cv,
        correction=corr, correction_weight=sum(r.ttft_correction_weight for r in serving if r.ttft_correction),
        waiting_tokens=sum(r.waiting_prefill_tokens for r in serving),
        running_tokens=sum(r.running_prefill_tokens for r in serving),
        saturation=sum(r.saturation for r in serving) / len(serving), ttft_observed_seconds=ttft)


def _weighted(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    num = den = 0.0
    for value, w in pairs:
        if value is not None and w > 0:
            num += value * w
            den += w
    return num / den if den > 0 else None
