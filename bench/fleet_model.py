"""The discrete-event fleet of ``bench/fleet_sim.py``: N DWDP groups serving a request trace, scaled by the
operator's own law (``dwdp_operator.autoscale.decide``) or by a fixed count (the oracle's windows).

What is modelled, as the worker does it (docs/SERVING.md): a group is ``pods_per_group`` pods of
``ranks_per_pod`` ranks; every pod has its own FIFO queue; an idle rank takes the longest queue prefix that
fits ``max_num_tokens`` into one forward, whose time is ``cost.forward_s(lengths)`` (the planner's roofline,
or measured tokens/s). A request's TTFT = its forward's end - its arrival. Requests reach a pod through a
*router*: ``pooled`` = the least-queued pod (a gateway's endpoint picker), ``random`` = a Service.
Every pod runs the worker's real ``LoadEstimator``; the operator tick reads each serving pod's
``LoadReport``, combines them (``autoscale_signals.combine``) and calls ``decide`` — the same code path as
``dwdp_operator.autoscaler``.

Assumptions (printed by the simulator): a new group is Ready ``startup_s`` after it is asked for
(scheduling, weights, warm-up); the first forward of each (rank, ISL bucket) takes ``first_pass_factor``
times its cost (kernels compile, autotune, graphs capture: Dynamo #12430); a scaled-down group leaves the
router at once and is deleted when its queue is empty (the operator's drain); group-hours count from
creation to deletion.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

from dwdp_operator.autoscale import DEFAULT_LEAD_S, Decision, QueueShape, ScaleHistory, decide
from dwdp_operator.autoscale_signals import combine
from dwdp_operator.spec import Autoscaling
from dwdp_runtime.load.estimator import RUNNING_REMAINING, LoadEstimator, QueueState
from dwdp_runtime.load.schema import isl_bucket


class RooflineCost:
    """Forward time of a packed batch from the planner (``Evaluator.forward``, the DWDP two-stream timeline):
    a batch of lengths l_i is the equal-length batch with the same tokens and attention pairs
    (``seq = Σl²/Σl``, ``batch = Σl / seq``)."""

    def __init__(self, *, model: str, dtype: str, hardware: str, dwdp_size: int, slots: int = 2):
        from dwdp_runtime.config import suggest_sharding
        from dwdp_runtime.planner.evaluator import Evaluator

        self.ev = Evaluator(model=model, dtype=dtype, hardware=hardware)
        k, s = suggest_sharding(dwdp_size=dwdp_size, num_experts=self.ev.shape.num_experts)
        self.pf, self.d, self.slots = self.ev.prefetch(dwdp_size=dwdp_size, k=k, s=s), dwdp_size, slots
        self.name = f"roofline {model} {dtype} {hardware} dwdpSize={dwdp_size}"

    def forward_s(self, lengths: list[int]) -> float:
        tokens = sum(lengths)
        seq = sum(n * n for n in lengths) / tokens
        # quantized: 1/8 octave in length, 1/16 octave in tokens — the cache stays small, the error < 5 %
        return self._cached(round(math.log2(seq) * 8), round(math.log2(tokens) * 16))

    @lru_cache(maxsize=None)
    def _cached(self, seq_q: int, tok_q: int) -> float:
        seq, tokens = 2 ** (seq_q / 8), 2 ** (tok_q / 16)
        return self.ev.forward(isl=seq, batch=max(tokens / seq, 1e-6), cv=0.0, d=self.d, pf=self.pf,
                               slots=self.slots)["dwdp_us"] / 1e6


@dataclass(frozen=True)
class MeasuredCost:
    """Forward time from a measured rate: ``max(floor_s, tokens / tokens_per_second)``."""

    tokens_per_second: float
    floor_s: float

    @property
    def name(self) -> str:
        return f"measured {self.tokens_per_second:.0f} tokens/s per rank, forward >= {self.floor_s:g}s"

    def forward_s(self, lengths: list[int]) -> float:
        return max(self.floor_s, sum(lengths) / self.tokens_per_second)


@dataclass(frozen=True)
class FleetConfig:
    ranks_per_pod: int
    pods_per_group: int
    max_num_tokens: int
    startup_s: float
    first_pass_factor: float
    router: str  # "pooled" | "random"

    @property
    def ranks_per_group(self) -> int:
        return self.ranks_per_pod * self.pods_per_group


@dataclass(eq=False)
class _Req:
    t: float
    isl: int
    predicted: float | None = None


@dataclass(eq=False)
class _Rank:
    gid: int
    batch: list | None = None
    started: float = 0.0
    seen: set = field(default_factory=set)


@dataclass(eq=False)
class _Pod:
    ranks: list[_Rank]
    estimator: LoadEstimator | None
    group: "_Group | None" = None
    queue: deque = field(default_factory=deque)
    waiting_tokens: int = 0
    running_tokens: int = 0

    def queue_state(self) -> QueueState:
        running = [r.isl for rk in self.ranks if rk.batch for r in rk.batch]
        return QueueState.of([r.isl for r in self.queue], running)

    @property
    def load(self) -> int:
        return self.waiting_tokens + self.running_tokens


@dataclass(eq=False)
class _Group:
    index: int
    created: float
    pods: list[_Pod]
    ready: bool = False
    draining: bool = False
    removed: float | None = None


@dataclass
class SimResult:
    ttft: list[float]                      # per request, in arrival order of completion
    arrival: list[float]
    group_seconds: float
    changes: list[tuple[float, int, int, str]] = field(default_factory=list)  # (t, from, to, reason)
    groups_over_time: list[tuple[float, int, int]] = field(default_factory=list)  # (t, numGroups, ready)


class Fleet:
    def __init__(self, cfg: FleetConfig, cost, *, policy: Autoscaling | None, groups: int, seed: int = 0,
                 estimators: bool = True, end_s: float):
        self.cfg, self.cost, self.policy, self.end_s = cfg, cost, policy, end_s
        self.rng = random.Random(seed)
        self.events: list = []
        self.seq = 0
        self.groups: list[_Group] = []
        self.estimators = estimators
        self.next_gid = 0
        self.history = ScaleHistory()
        self.shape = QueueShape(cfg.ranks_per_group, None if cfg.router == "pooled" else cfg.ranks_per_pod)
        self.result = SimResult(ttft=[], arrival=[], group_seconds=0.0)
        self.last: Decision | None = None
        self.lead_s: float | None = None
        for _ in range(groups):
            self._add_group(0.0, ready_now=True)

    # -- structure ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, obj) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def _add_group(self, now: float, *, ready_now: bool) -> None:
        pods = []
        for _ in range(self.cfg.pods_per_group):
            ranks = [_Rank(self._gid()) for _ in range(self.cfg.ranks_per_pod)]
            est = LoadEstimator(max_num_tokens=self.cfg.max_num_tokens, start=now) if self.estimators else None
            pods.append(_Pod(ranks, est))
        g = _Group(len(self.groups), now, pods)
        for p in pods:
            p.group = g
        self.groups.append(g)
        if ready_now:
            g.ready = True
        else:
            self._push(now + self.cfg.startup_s, "ready", g)

    def _gid(self) -> int:
        self.next_gid += 1
        return self.next_gid

    def live(self) -> list[_Group]:
        return [g for g in self.groups if g.removed is None and not g.draining]

    def serving(self) -> list[_Pod]:
        return [p for g in self.groups if g.ready and not g.draining and g.removed is None for p in g.pods]

    # -- the run --------------------------------------------------------------------------------------
    def run(self, arrivals: list[tuple[float, int]], *, count_from: float = 0.0) -> SimResult:
        if self.policy is not None:
            self._push(self.policy.intervalSeconds, "tick", None)
        i = 0
        while i < len(arrivals) or self.events:
            if self.events and (i >= len(arrivals) or self.events[0][0] <= arrivals[i][0]):
                t, _, kind, obj = heapq.heappop(self.events)
                if kind == "done":
                    self._done(obj, t, count_from)
                elif kind == "ready":
                    obj.ready = True
                    sample = t - obj.created   # the lead the law sizes bursts for, measured as the operator does
                    self.lead_s = sample if self.lead_s is None else 0.3 * sample + 0.7 * self.lead_s
                    for pod in obj.pods:
                        self._start(pod, t)
                elif kind == "tick" and t < self.end_s:
                    self._tick(t)
                    self._push(t + self.policy.intervalSeconds, "tick", None)
            else:
                t, isl = arrivals[i]
                i += 1
                self._arrive(_Req(t, isl), t)
        for g in self.groups:
            self.result.group_seconds += (min(g.removed, self.end_s) if g.removed is not None else self.end_s) - g.created
        return self.result

    def _arrive(self, req: _Req, now: float) -> None:
        pods = self.serving()
        if not pods:  # nothing serving yet (a fleet at 0 ready): the request waits on the first pod that will
            pods = [p for g in self.live() for p in g.pods]
        pod = min(pods, key=lambda p: p.load) if self.cfg.router == "pooled" else self.rng.choice(pods)
        if pod.estimator is not None:
            queued = pod.waiting_tokens + RUNNING_REMAINING * pod.running_tokens
            req.predicted = pod.estimator.ttft_estimate_for(req.isl, queued, len(pod.ranks), now)
            pod.estimator.admitted(req.isl, now)
        pod.queue.append(req)
        pod.waiting_tokens += req.isl
        self._start(pod, now)

    def _start(self, pod: _Pod, now: float) -> None:
        for rank in pod.ranks:
            if rank.batch is not None or not pod.queue:
                continue
            if not pod.group.ready:
                return
            batch, tokens = [], 0
            while pod.queue and tokens + pod.queue[0].isl <= self.cfg.max_num_tokens:
                r = pod.queue.popleft()
                batch.append(r)
                tokens += r.isl
            if not batch:  # a prompt longer than a forward (never in our traces): it runs alone
                batch = [pod.queue.popleft()]
            lengths = [r.isl for r in batch]
            pod.waiting_tokens -= sum(lengths)
            pod.running_tokens += sum(lengths)
            f = self.cost.forward_s(lengths)
            buckets = {isl_bucket(n) for n in lengths}
            if buckets - rank.seen:
                f *= self.cfg.first_pass_factor
                rank.seen |= buckets
            rank.batch, rank.started = batch, now
            self._push(now + f, "done", (pod, rank))

    def _done(self, obj, now: float, count_from: float) -> None:
        pod, rank = obj
        batch, rank.batch = rank.batch, None
        lengths = [r.isl for r in batch]
        pod.running_tokens -= sum(lengths)
        for r in batch:
            if r.t >= count_from:
                self.result.ttft.append(now - r.t)
                self.result.arrival.append(r.t)
        if pod.estimator is not None:
            pod.estimator.forward_done(rank.gid, lengths, now - rank.started, now)
            for r in batch:
                pod.estimator.first_token(now - r.t, r.predicted, now)
        self._start(pod, now)
        self._reap(now)

    def _reap(self, now: float) -> None:
        for g in self.groups:
            if g.draining and g.removed is None and all(not p.queue and not any(r.batch for r in p.ranks) for p in g.pods):
                g.removed = now

    # -- the operator ---------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        reports = [p.estimator.report(p.queue_state(), ranks=len(p.ranks), ready=True, draining=g.draining, now=now)
                   for g in self.groups if g.ready and g.removed is None for p in g.pods]
        live = self.live()
        current = len(live)
        d = decide(combine(reports), self.history, self.policy, self.shape, current=current, now=now,
                   lead_s=self.lead_s if self.lead_s is not None else DEFAULT_LEAD_S)
        self.history, self.last = d.history, d
        if d.desired > current:
            revived = [g for g in self.groups if g.draining and g.removed is None][: d.desired - current]
            for g in revived:
                g.draining = False
            for _ in range(d.desired - current - len(revived)):
                self._add_group(now, ready_now=False)
        elif d.desired < current:
            for g in sorted(live, key=lambda g: -g.index)[: current - d.desired]:
                g.draining = True  # leaves the router now; deleted once its queue is empty
            self._reap(now)
        if d.desired != current:
            self.result.changes.append((now, current, d.desired, str(d.reason)))
        self.result.groups_over_time.append((now, d.desired, sum(1 for g in self.live() if g.ready)))
