"""``LoadEstimator``: a front's prefill load from what it already knows — admitted prompt lengths, each
forward's lengths and wall time, each request's first-token time (pure: ``now`` is an argument).

Model (docs/OPERATOR.md, "Autoscaling", says why each choice):
  * **Throughput per ISL bucket** ``tput_b`` = decayed Σ w·tokens / Σ w·seconds over the forwards that
    carried bucket-b prompts; a forward's seconds are shared by its sequences by token share, and every
    sample is weighted by the forward's fill ``w = tokens / max_num_tokens``: a DWDP forward costs at
    least one prefetch of the experts, so a lone short prompt measures the floor, not the capacity —
    full forwards say what the ranks can do under load and they dominate the estimate; with no full
    forward yet the estimate is the lone ones' (conservative: it over-states work).
  * **Slow first passes** (Dynamo #12430: new workers' first forwards inflate the replica count): the
    first ``FIRST_PASSES_SKIPPED`` forwards of each (rank, bucket) are not throughput samples — kernels
    compile and autotune, CUDA graphs capture there.
  * A bucket without samples borrows the nearest measured bucket's rate (the longer one on a tie).
  * **Work** of ``n`` tokens of bucket b = ``n / tput_b`` rank-seconds. ``offered_load`` = Σ_b arrival
    rate_b / tput_b; ``backlog_seconds`` = Σ_b (waiting_b + running_b) / tput_b; ``drain_seconds`` =
    backlog / ranks (FIFO over parallel ranks).
  * **TTFT estimate** of a new prompt of length L = drain_seconds + max(L / tput(L), forward_seconds):
    it waits for the queue ahead, then rides a forward that takes at least a forward's time.
  * **Correction**: for each request the front records the estimate at admission and the TTFT it got;
    ``ttft_correction`` = decayed Σ observed / Σ predicted — Dynamo's "measured ÷ expected latency",
    here against our own prediction, so it captures what forward times miss (dispatch gaps, tokenizing).
  * **Saturation** = min(1, max(busy_fraction, (offered_load + backlog / SATURATION_HORIZON_S) / ranks)).

Invariants: every reported number is finite and non-negative; nothing here reads a clock or does I/O;
memory is bounded (ranks × buckets counters).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .decay import Decayed, DecayedFit, ratio
from .schema import NUM_BUCKETS, BucketLoad, LoadReport, TtftEstimate, bucket_edge, isl_bucket

#: throughput changes with the model, the packing and the hardware, not second to second: a slow memory
THROUGHPUT_HALF_LIFE_S = 120.0
#: arrivals must show a burst within seconds (the autoscaler's panic mode reads them); 10 s is also the
#: operator's read period × 2, so one missed read does not hide a change
ARRIVAL_HALF_LIFE_S = 10.0
BUSY_HALF_LIFE_S = 30.0
#: the latency correction moves slowly: it is a bias of the model, not a load signal
CORRECTION_HALF_LIFE_S = 120.0
#: forwards of each (rank, bucket) that never count as throughput samples (compile, autotune, graph capture)
FIRST_PASSES_SKIPPED = 2
#: the packing efficiency of the arrival mix moves with the mix (a half-life of seconds): once a second is enough
EFFICIENCY_REFRESH_S = 1.0
#: a backlog counts as the load that would clear it in this long (saturation only; the operator sizes its own)
SATURATION_HORIZON_S = 30.0


@dataclass(frozen=True)
class QueueState:
    """What is queued and running on a front now: prompt lengths of the sequences still in prefill."""

    waiting: tuple[int, ...] = ()   # admitted, not yet in any forward
    running: tuple[int, ...] = ()   # in their first (prefill) forward now
    running_requests: int = 0       # sequences in or between forwards (prefill and decode steps)

    @classmethod
    def of(cls, waiting: Iterable[int], running: Iterable[int], running_requests: int | None = None) -> "QueueState":
        w, r = tuple(int(x) for x in waiting), tuple(int(x) for x in running)
        return cls(w, r, len(r) if running_requests is None else running_requests)


@dataclass
class _Bucket:
    fit: DecayedFit     # forward seconds against the forward's tokens, for forwards carrying this bucket
    arrivals: Decayed


@dataclass
class LoadEstimator:
    max_num_tokens: int
    start: float
    buckets: list[_Bucket] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        s = self.start
        self.buckets = [_Bucket(DecayedFit(THROUGHPUT_HALF_LIFE_S, s), Decayed(ARRIVAL_HALF_LIFE_S, s))
                        for _ in range(NUM_BUCKETS)]
        self._fwd_seconds = Decayed(THROUGHPUT_HALF_LIFE_S, s)    # Σ forward seconds
        self._forwards = Decayed(THROUGHPUT_HALF_LIFE_S, s)       # Σ forwards
        self._busy = Decayed(BUSY_HALF_LIFE_S, s)                 # Σ busy rank-seconds
        self._arrived = Decayed(ARRIVAL_HALF_LIFE_S, s)            # Σ admitted prompts (count)
        self._arrived_tokens = Decayed(ARRIVAL_HALF_LIFE_S, s)
        self._ttft = Decayed(CORRECTION_HALF_LIFE_S, s)           # Σ observed TTFT, every answered request
        self._answered = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._observed = Decayed(CORRECTION_HALF_LIFE_S, s)       # Σ observed TTFT, requests with a prediction
        self._predicted = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._predictions = Decayed(CORRECTION_HALF_LIFE_S, s)
        self._passes: dict[tuple[int, int], int] = {}
        self._efficiency: tuple[float | None, float] = (None, 1.0)

    # -- samples ------------------------------------------------------------------------------------
    def admitted(self, length: int, now: float) -> None:
        """A prompt of ``length`` tokens entered the queue."""
        if length > 0:
            self.buckets[isl_bucket(length)].arrivals.add(float(length), now)
            self._arrived.add(1.0, now)
            self._arrived_tokens.add(float(length), now)

    def forward_done(self, rank: int, lengths: Sequence[int], seconds: float, now: float) -> None:
        """A forward on ``rank`` that prefilled prompts of ``lengths`` took ``seconds`` of wall time."""
        total = sum(lengths)
        if total <= 0 or not seconds > 0:
            return
        self._busy.add(seconds, now)
        self._fwd_seconds.add(seconds, now)
        self._forwards.add(1.0, now)
        by_bucket: dict[int, int] = {}
        for n in lengths:
            by_bucket[isl_bucket(n)] = by_bucket.get(isl_bucket(n), 0) + n
        for b, tokens in by_bucket.items():
            seen = self._passes.get((rank, b), 0)
            self._passes[(rank, b)] = seen + 1
            if seen < FIRST_PASSES_SKIPPED:
                continue
            self.buckets[b].fit.add(float(total), seconds, tokens / total, now)

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
    def throughput(self, now: float) -> list[float | None]:
        """Per bucket, one rank's tokens/s in full forwards: ``max_num_tokens / F(max_num_tokens)`` with F the
        bucket's fit of forward time against forward tokens, never faster than its forwards ran (None: never
        measured)."""
        out: list[float | None] = []
        k = float(self.max_num_tokens)
        for b in self.buckets:
            full, mean = b.fit.predict(k, now), b.fit.mean_y(now)
            out.append(None if full is None or mean is None or max(full, mean) <= 0 else k / max(full, mean))
        return out

    def filled_throughput(self, now: float) -> list[float | None]:
        """Per bucket, its own rate or the nearest measured bucket's (the longer on a tie); all None if none."""
        return fill_nearest(self.throughput(now))

    def forward_seconds(self, now: float) -> float | None:
        """Decayed mean forward time (what a request's own forward takes)."""
        return ratio(self._fwd_seconds, self._forwards, now)

    def efficiency(self, now: float) -> float:
        """How full FIFO packing fills a forward with the recent arrivals' mix (``packing_efficiency``),
        recomputed at most every ``EFFICIENCY_REFRESH_S`` (it is asked for on every admission)."""
        at, value = self._efficiency
        if at is None or not 0 <= now - at < EFFICIENCY_REFRESH_S:
            value = packing_efficiency([b.arrivals.value(now) for b in self.buckets], self.max_num_tokens)
            self._efficiency = (now, value)
        return value

    def effective_throughput(self, now: float) -> list[float | None]:
        """Tokens/s per bucket of a rank packing the recent mix: full-forward rate × packing efficiency."""
        eff = self.efficiency(now)
        return [None if t is None else t * eff for t in self.filled_throughput(now)]

    def ttft_estimate(self, length: int, queue: QueueState, ranks: int, now: float) -> float | None:
        return self.ttft_estimate_by_bucket(length, queued_tokens(queue), ranks, now)

    def ttft_estimate_by_bucket(self, length: int, queued_by_bucket: Sequence[float], ranks: int,
                                now: float) -> float | None:
        """``ttft_estimate`` for a queue already tallied per bucket (prompt tokens)."""
        tput = self.effective_throughput(now)
        return self._ttft_of(length, work(queued_by_bucket, tput), tput, ranks, self.forward_seconds(now))

    @staticmethod
    def _ttft_of(length: int, backlog: float | None, tput: Sequence[float | None], ranks: int,
                 forward_s: float | None) -> float | None:
        own = tput[isl_bucket(length)]
        if backlog is None or own is None:
            return None
        return backlog / max(ranks, 1) + max(length / own, forward_s or 0.0)

    def report(self, queue: QueueState, *, ranks: int, ready: bool, draining: bool, now: float,
               isl: int | None = None) -> LoadReport:
        tput = self.effective_throughput(now)
        measured = self.throughput(now)
        waiting, running = _by_bucket(queue.waiting), _by_bucket(queue.running)
        arrivals = [b.arrivals.rate(now) for b in self.buckets]
        offered = work(arrivals, tput)
        backlog = work(queued_tokens(queue), tput)
        n = max(ranks, 1)
        forward_s = self.forward_seconds(now)
        busy = min(1.0, self._busy.rate(now) / n)
        if offered is None or backlog is None:
            saturation = busy
        else:
            saturation = min(1.0, max(busy, (offered + backlog / SATURATION_HORIZON_S) / n))
        observed, predicted = self._observed.value(now), self._predicted.value(now)
        corrected = predicted > 0 and observed > 0
        estimate = None
        length = isl or self.mean_arrival_length(now)
        if length:
            seconds = self.ttft_estimate(length, queue, ranks, now)
            if seconds is not None:
                estimate = TtftEstimate(isl=length, seconds=seconds)
        return LoadReport(
            ready=ready, draining=draining, ranks=ranks, max_num_tokens=self.max_num_tokens,
            packing_efficiency=self.efficiency(now),
            waiting_requests=len(queue.waiting), running_requests=queue.running_requests,
            waiting_prefill_tokens=sum(queue.waiting), running_prefill_tokens=sum(queue.running),
            buckets=[BucketLoad(isl_le=bucket_edge(i), tokens_per_second=measured[i],
                                weight_seconds=self.buckets[i].fit.weighted_y(now),
                                arrival_tokens_per_second=arrivals[i], waiting_tokens=waiting[i],
                                running_tokens=running[i],
                                ttft_estimate_seconds=self._ttft_of(bucket_edge(i), backlog, tput, ranks, forward_s)
                                if measured[i] and bucket_edge(i) else None) for i in range(NUM_BUCKETS)],
            offered_load=offered, backlog_seconds=backlog,
            drain_seconds=None if backlog is None else backlog / n,
            forward_seconds=forward_s, busy_fraction=busy, saturation=saturation,
            ttft_estimate=estimate,
            ttft_observed_seconds=ratio(self._ttft, self._answered, now),
            ttft_correction=observed / predicted if corrected else None,
            ttft_correction_weight=self._predictions.value(now) if corrected else 0.0)

    def mean_arrival_length(self, now: float) -> int | None:
        """Decay-weighted mean prompt length of recent arrivals; None before the first."""
        r = ratio(self._arrived_tokens, self._arrived, now)
        return None if r is None else max(1, round(r))

    def busy_rate(self, now: float) -> float:
        """Rank-seconds spent in forwards per second (decayed)."""
        return self._busy.rate(now)


#: prompts drawn from a bucket mix to measure how full FIFO packing fills a forward (deterministic)
PACKING_DRAWS = 256


def bucket_range(index: int) -> tuple[float, float]:
    """A bucket's prompt lengths (lo, hi]; the first starts at half its edge, the open one ends at twice its start."""
    hi, lo = bucket_edge(index), bucket_edge(index - 1) if index > 0 else None
    if hi is None:
        return float(lo), 2.0 * lo
    return float(lo if lo is not None else hi / 2), float(hi)


def packing_efficiency(tokens_by_bucket: Sequence[float], max_num_tokens: int) -> float:
    """The share of ``max_num_tokens`` a forward carries when FIFO packing (the worker's ``batcher.pack``)
    takes prompts of this mix from a long queue: in (0, 1]; 1.0 for an empty mix.

    A queue of ``PACKING_DRAWS`` prompts is packed prefix by prefix: bucket by the mix's share of requests
    (tokens / the bucket's mean length), length log-uniform inside the bucket, both from low-discrepancy
    sequences (deterministic); a prompt longer than a forward fills one forward on its own."""
    ranges = [bucket_range(i) for i in range(len(tokens_by_bucket))]
    means = [(hi - lo) / math.log(hi / lo) for lo, hi in ranges]
    reqs = [t / m for t, m in zip(tokens_by_bucket, means)]
    total = sum(reqs)
    if total <= 0:
        return 1.0
    cum, acc = [], 0.0
    for r in reqs:
        acc += r / total
        cum.append(acc)
    forwards, carried, current = 0, 0.0, 0.0
    for i in range(PACKING_DRAWS):
        b = min(bisect_right(cum, (i * _GOLDEN) % 1.0), len(cum) - 1)
        lo, hi = ranges[b]
        n = min(lo * (hi / lo) ** ((i * _SQRT2) % 1.0), max_num_tokens)
        if current and current + n > max_num_tokens:
            forwards += 1
            carried += current
            current = 0.0
        current += n
    return (carried + current) / ((forwards + 1) * max_num_tokens)


_GOLDEN = (math.sqrt(5) - 1) / 2   # two independent low-discrepancy sequences (Weyl, irrational steps)
_SQRT2 = math.sqrt(2) - 1


#: a running forward is, on average, half done when a new request arrives
RUNNING_REMAINING = 0.5


def queued_tokens(queue: QueueState) -> list[float]:
    """Prompt tokens per bucket still ahead of a new request: the waiting ones and half the running ones."""
    return [w + RUNNING_REMAINING * r for w, r in zip(_by_bucket(queue.waiting), _by_bucket(queue.running))]


def _by_bucket(lengths: Iterable[int]) -> list[int]:
    out = [0] * NUM_BUCKETS
    for n in lengths:
        if n > 0:
            out[isl_bucket(n)] += n
    return out


def fill_nearest(tput: Sequence[float | None]) -> list[float | None]:
    """Each unmeasured entry takes the nearest measured one's value (the later index on a tie)."""
    known = [i for i, v in enumerate(tput) if v is not None and v > 0]
    if not known:
        return [None] * len(tput)
    return [tput[i] if i in known else tput[min(known, key=lambda k: (abs(k - i), -k))] for i in range(len(tput))]


def work(tokens_by_bucket: Sequence[float], tput: Sequence[float | None]) -> float | None:
    """Σ tokens_b / tput_b in rank-seconds; None when no rate is known (0 with no tokens is still 0)."""
    if all(t is None for t in tput):
        return None if any(tokens_by_bucket) else 0.0
    return sum(n / t for n, t in zip(tokens_by_bucket, tput) if n and t)
