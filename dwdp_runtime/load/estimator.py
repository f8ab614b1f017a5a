"""``LoadEstimator``: a front's prefill load from what it already knows — admitted prompt lengths, each
forward's lengths and wall time, each request's first-token time (pure: ``now`` is an argument).

Model (docs/OPERATOR.md, "Autoscaling", says why each choice):
  * **Capacity** comes from a measured roofline of the front's forwards (``forward_model``: the seconds of
    a forward = max(floor, a·tokens + b·attention pairs)) applied to the mix of prompt lengths FIFO-packed
    into forwards of ``max_num_tokens`` (``mix_capacity``). A DWDP forward costs at least one prefetch of
    the experts, so tokens/s measured on the forwards that happened (small ones at low load) is not the
    capacity under load; the model says what a full queue would get.
  * **Per ISL bucket** tokens/s (``LoadReport.buckets``): the same model on a queue of that bucket's prompts.
  * **Slow first passes** (Dynamo #12430: new workers' first forwards inflate the replica count): a forward
    carrying a bucket for one of the first ``FIRST_PASSES_SKIPPED`` times on its rank is no sample of the
    model — kernels compile and autotune, CUDA graphs capture there.
  * **Work** of a set of prompts = their tokens / the capacity on the arrivals' mix, in rank-seconds:
    ``offered_load`` for the arrival rate, ``backlog_seconds`` for the queue (waiting prompts and half of
    the running ones: a running forward is half done on average); ``drain_seconds`` = backlog / ranks.
  * **TTFT estimate** of a new prompt of length L = drain_seconds + max(its lone forward, the mean forward).
  * **Correction**: each request's TTFT against the estimate it had at admission; ``ttft_correction`` =
    decayed Σ observed / Σ predicted — Dynamo's "measured ÷ expected latency", against our own prediction.
  * **Saturation** = min(1, max(busy_fraction, (offered_load + backlog / SATURATION_HORIZON_S) / ranks)).

Invariants: every reported number is finite and non-negative; nothing here reads a clock or does I/O;
memory is bounded (ranks × buckets counters, ``forward_model.FLOOR_WINDOWS`` floors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .decay import Decayed, ratio
from .forward_model import ForwardModelFit, bucket_capacity, mix_capacity
from .schema import NUM_BUCKETS, BucketLoad, ForwardCost, LoadReport, TtftEstimate, bucket_edge, isl_bucket

#: arrivals must show a burst within seconds (the autoscaler's panic mode reads them); 10 s is also the
#: operator's read period × 2, so one missed read does not hide a change
ARRIVAL_HALF_LIFE_S = 10.0
BUSY_HALF_LIFE_S = 30.0
#: a bucket's mean prompt length (where the capacity model draws its prompts) follows the traffic in minutes
LENGTH_HALF_LIFE_S = 120.0
#: the latency correction moves slowly: it is a bias of the model, not a load signal
CORRECTION_HALF_LIFE_S = 120.0
#: forwards of each (rank, bucket) that never count as model samples (compile, autotune, graph capture)
FIRST_PASSES_SKIPPED = 2
#: a backlog counts as the load that would clear it in this long (saturation only; the operator sizes its own)
SATURATION_HORIZON_S = 30.0
#: the capacity of the arrival mix moves with the mix (a half-life of seconds): once a second is enough
CAPACITY_REFRESH_S = 1.0
#: model samples the capacity cache tells apart: past this many one more sample moves the capacity little, and
#: the once-a-second refresh takes it in
SAMPLES_COUNTED = 64
#: a running forward is, on average, half done when a new request arrives
RUNNING_REMAINING = 0.5


@dataclass(frozen=True)
class QueueState:
    """What is queued and running on a front now: prompt lengths of the sequences still to prefill."""

    waiting: tuple[int, ...] = ()   # waiting for a rank
    running: tuple[int, ...] = ()   # in a forward now
    running_requests: int = 0       # admitted sequences not waiting

    @classmethod
    def of(cls, waiting: Iterable[int], running: Iterable[int], running_requests: int | None = None) -> "QueueState":
        w, r = tuple(int(x) for x in waiting), tuple(int(x) for x in running)
        return cls(w, r, len(r) if running_requests is None else running_requests)


@dataclass
class LoadEstimator:
    max_num_tokens: int
    start: float
    model: ForwardModelFit = field(init=False)

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        s = self.start
        self.model = ForwardModelFit(start=s)
        self._arrivals = [Decayed(ARRIVAL_HALF_LIFE_S, s) for _ in range(NUM_BUCKETS)]   # tokens per bucket
        self._lengths = [Decayed(LENGTH_HALF_LIFE_S, s) for _ in range(NUM_BUCKETS)]     # tokens, for the mean
        self._counts = [Decayed(LENGTH_HALF_LIFE_S, s) for _ in range(NUM_BUCKETS)]      # prompts
        self._carried = [Decayed(BUSY_HALF_LIFE_S, s) for _ in range(NUM_BUCKETS)]       # forward-seconds per bucket
        self._seen = [False] * NUM_BUCKETS
        self._fwd_seconds = Decayed(BUSY_HALF_LIFE_S, s)
        self._fwd_squares = Decayed(BUSY_HALF_LIFE_S, s)   # Σ seconds², for the forwards' variation
        self._forwards = Decayed(BUSY_HALF_LIFE_S, s)
        self._arrived = Decayed(ARRIVAL_HALF_LIFE_S, s)
        self._ttft = Decayed(CORRECTION_HALF_LIFE_S, s)           # Σ observed TTFT, every answered request
        self._answered = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._observed = Decayed(CORRECTION_HALF_LIFE_S, s)       # Σ observed TTFT, requests with a prediction
        self._predicted = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._predictions = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._passes: dict[tuple[int, int], int] = {}
        self._capacity: tuple[float | None, int, float | None] = (None, 0, None)
        self._samples = 0

    # -- samples ------------------------------------------------------------------------------------
    def admitted(self, length: int, now: float) -> None:
        """A prompt of ``length`` tokens entered the queue."""
        if length > 0:
            b = isl_bucket(length)
            self._arrivals[b].add(float(length), now)
            self._lengths[b].add(float(length), now)
            self._counts[b].add(1.0, now)
            self._arrived.add(1.0, now)

    def forward_done(self, rank: int, lengths: Sequence[int], seconds: float, now: float) -> None:
        """A forward on ``rank`` that prefilled prompts of ``lengths`` took ``seconds`` of wall time."""
        total = sum(lengths)
        if total <= 0 or not seconds > 0:
            return
        self._fwd_seconds.add(seconds, now)
        self._fwd_squares.add(seconds * seconds, now)
        self._forwards.add(1.0, now)
        first_pass = False
        for b in {isl_bucket(n) for n in lengths if n > 0}:
            seen = self._passes.get((rank, b), 0)
            self._passes[(rank, b)] = seen + 1
            first_pass |= seen < FIRST_PASSES_SKIPPED
            self._carried[b].add(seconds, now)
            self._seen[b] = True
        if not first_pass:
            self.model.add(lengths, seconds, now)
            self._samples = min(self._samples + 1, SAMPLES_COUNTED)

    def first_token(self, observed_s: float, predicted_s: float | None, now: float) -> None:
        """A request got its first token ``observed_s`` after admission; ``predicted_s`` was the estimate then."""
        if observed_s < 0:
            return
        self._answered.add(1.0, now)
        self._ttft.add(observed_s, now)
        if predicted_s is not None and predicted_s > 0:
            self._predictions.add(1.0, now)
            self._observed.add(observed_s, now)
            self._predicted.add(predicted_s, now)

    # -- estimates ----------------------------------------------------------------------------------
    def cost(self, now: float) -> ForwardCost | None:
        return self.model.cost(now)

    def capacity(self, now: float) -> float | None:
        """One rank's tokens/s on the recent arrivals' mix (None before a measured forward), recomputed at
        most every ``CAPACITY_REFRESH_S`` (it is asked for on every admission) and whenever the number of
        model samples changed since (the first ones must count at once)."""
        at, samples, value = self._capacity
        if at is None or samples != self._samples or not 0 <= now - at < CAPACITY_REFRESH_S:
            cost = self.cost(now)
            mix = [a.value(now) for a in self._arrivals]
            if not any(mix):
                mix = [c.value(now) for c in self._carried]
            value = None if cost is None else mix_capacity(cost, mix, self.max_num_tokens, self.mean_lengths(now))
            self._capacity = (now, self._samples, value)
        return value

    def forward_cv(self, now: float) -> float | None:
        """Coefficient of variation of the forward times (decayed): the queue model's service variability."""
        mean, square = ratio(self._fwd_seconds, self._forwards, now), ratio(self._fwd_squares, self._forwards, now)
        if mean is None or square is None or mean <= 0:
            return None
        return max(0.0, square - mean * mean) ** 0.5 / mean

    def mean_lengths(self, now: float) -> list[float | None]:
        """Decayed mean prompt length per bucket (None: none seen)."""
        return [ratio(t, c, now) for t, c in zip(self._lengths, self._counts)]

    def forward_seconds(self, now: float) -> float | None:
        """Decayed mean forward time."""
        return ratio(self._fwd_seconds, self._forwards, now)

    def ttft_estimate(self, length: int, queue: QueueState, ranks: int, now: float) -> float | None:
        return self.ttft_estimate_for(length, queued_tokens(queue), ranks, now)

    def ttft_estimate_for(self, length: int, queued: float, ranks: int, now: float) -> float | None:
        """``ttft_estimate`` for ``queued`` prompt tokens ahead (``queued_tokens``)."""
        capacity, cost = self.capacity(now), self.cost(now)
        if capacity is None or cost is None:
            return None
        return queued / capacity / max(ranks, 1) + max(cost.seconds(length, float(length) ** 2),
                                                       self.forward_seconds(now) or 0.0)

    def report(self, queue: QueueState, *, ranks: int, ready: bool, draining: bool, now: float,
               isl: int | None = None) -> LoadReport:
        cost, capacity = self.cost(now), self.capacity(now)
        arrivals = [a.rate(now) for a in self._arrivals]
        waiting, running = _by_bucket(queue.waiting), _by_bucket(queue.running)
        n = max(ranks, 1)
        offered = None if capacity is None else sum(arrivals) / capacity
        backlog = None if capacity is None else queued_tokens(queue) / capacity
        busy = min(1.0, self._fwd_seconds.rate(now) / n)
        saturation = busy if offered is None else min(1.0, max(busy, (offered + backlog / SATURATION_HORIZON_S) / n))
        forward_s = self.forward_seconds(now)
        means = self.mean_lengths(now)
        observed, predicted = self._observed.value(now), self._predicted.value(now)
        corrected = predicted > 0 and observed > 0
        length = isl or self.mean_arrival_length(now)
        estimate = None if not length else self.ttft_estimate(length, queue, ranks, now)

        def bucket(i: int) -> BucketLoad:
            tput = bucket_capacity(cost, i, self.max_num_tokens, means[i]) if cost is not None and self._seen[i] else None
            edge = bucket_edge(i)
            ttft = None if tput is None or edge is None or backlog is None else \
                backlog / n + max(cost.seconds(edge, float(edge) ** 2), forward_s or 0.0)
            return BucketLoad(isl_le=edge, tokens_per_second=tput, weight_seconds=self._carried[i].value(now),
                              arrival_tokens_per_second=arrivals[i], mean_length=means[i], waiting_tokens=waiting[i],
                              running_tokens=running[i], ttft_estimate_seconds=ttft)

        return LoadReport(
            ready=ready, draining=draining, ranks=ranks, max_num_tokens=self.max_num_tokens, forward_cost=cost,
            waiting_requests=len(queue.waiting), running_requests=queue.running_requests,
            waiting_prefill_tokens=sum(queue.waiting), running_prefill_tokens=sum(queue.running),
            buckets=[bucket(i) for i in range(NUM_BUCKETS)],
            offered_load=offered, backlog_seconds=backlog, drain_seconds=None if backlog is None else backlog / n,
            forward_seconds=forward_s, forward_cv=self.forward_cv(now), busy_fraction=busy, saturation=saturation,
            ttft_estimate=None if estimate is None else TtftEstimate(isl=length, seconds=estimate),
            ttft_observed_seconds=ratio(self._ttft, self._answered, now),
            ttft_correction=observed / predicted if corrected else None,
            ttft_correction_weight=self._predictions.value(now) if corrected else 0.0)

    def mean_arrival_length(self, now: float) -> int | None:
        """Decay-weighted mean prompt length of recent arrivals; None before the first."""
        tokens, count = sum(a.value(now) for a in self._arrivals), self._arrived.value(now)
        return max(1, round(tokens / count)) if count > 0 else None


def queued_tokens(queue: QueueState) -> float:
    """Prompt tokens ahead of a new request: the waiting ones and half the running ones."""
    return sum(queue.waiting) + RUNNING_REMAINING * sum(queue.running)


def _by_bucket(lengths: Iterable[int]) -> list[int]:
    out = [0] * NUM_BUCKETS
    for n in lengths:
        if n > 0:
            out[isl_bucket(n)] += n
    return out
