"""The autoscaling law (pure): fleet signals + the decision history + ``spec.autoscaling`` -> numGroups.

One implementation: the operator runs it on every autoscaling tick (``autoscaler.py``), the fleet
simulator (``bench/fleet_sim.py``) imports it. docs/OPERATOR.md, "Autoscaling", justifies each step
against the anchors (Dynamo's planner, AIBrix's KPA, llm-d's WVA).

  1. **Load** ``a`` (erlangs = rank-seconds per second) = corr · (offered + min(backlog / BACKLOG_HORIZON_S,
     offered)): the throughput law — prefill tokens arriving per second over the fleet's measured capacity
     for that mix of lengths (Dynamo's ``rate · ISL / tput(ISL)``, with a measured roofline instead of a
     pre-deployment profile) — plus what it takes to clear the queue already there within the horizon
     (at most doubling the fleet). ``offered`` is averaged over STABLE_WINDOW_S (KPA's stable window)
     for the up and down recommendations; the burst recommendation uses the signal now.
     ``corr`` = observed ÷ predicted TTFT (Dynamo's measured ÷ expected latency), bounded to
     ``CORRECTION_BOUNDS`` (it only ever raises the load) and used once ``CORRECTION_MIN_WEIGHT``
     requests stand behind it.
  2. **Wait budget** ``q`` = targetQueueSeconds, and/or targetTTFTSeconds minus one forward (the request's
     own), never below ``MIN_WAIT_SHARE`` of the TTFT target.
  3. **Ranks** for ``a`` such that P(wait > q) <= ``MISS`` (``autoscale_queue.servers_for``: Erlang C on
     forwards with the Allen-Cunneen correction for the forwards' measured variation, one pooled queue
     behind an endpoint picker, else one queue per pod) -> groups ``up``.
     The same for ``a · (1 + DOWN_MARGIN)`` -> ``down``: a smaller fleet must carry the load with margin
     (llm-d WVA: scale down only when the load fits the smaller fleet) — the stable load and the load now.
  4. **Panic** (AIBrix KPA): the burst recommendation ``>= PANIC_RATIO × current``, or the queue's drain
     time above ``PANIC_DRAIN_RATIO × q`` -> scale up now (no up-stabilization), to what the offered load
     projected one group start-up ahead along its rise of the last TREND_WINDOW_S asks for
     (``projected``: new groups serve the load of then, not of now), and no scale-down for panicHoldSeconds (PANIC_HOLD_S, 60 s, by default).
  5. **Stabilization** (HPA's semantics): scale up to the *lowest* ``up`` of the last
     scaleUpStabilizationSeconds, down to the *highest* ``down`` of the last scaleDownStabilizationSeconds
     — and down only once the history covers that whole window (after an operator restart, too).
  6. At most ``maxStep`` groups per decision; always inside [minGroups, maxGroups].

Invariants: ``decide`` never raises for any signals; ``desired`` is always in [minGroups, maxGroups]; with
no measurement anywhere it holds (clamped into the bounds); a scale-down never follows a panic within
panicHoldSeconds, nor a higher recommendation within the down window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from .autoscale_queue import servers_for
from .autoscale_signals import FleetSignals
from .spec import Autoscaling, DwdpGroupSpec, register_check

MISS = 0.05                  # the SLO is "95 % of requests within target"
BACKLOG_HORIZON_S = 30.0     # clear an existing queue within this (faster costs groups that idle once it is gone)
DOWN_MARGIN = 0.05           # the smaller fleet must carry 5 % more than the load now
PANIC_RATIO = 2.0            # KPA's panic threshold: the load asks for twice the fleet
PANIC_DRAIN_RATIO = 2.0      # or the queue already takes twice the wait budget to drain
# KPA's panic window: no scale-down this long after the last panic signal (spec.autoscaling.panicHoldSeconds' default)
PANIC_HOLD_S = Autoscaling.model_fields["panicHoldSeconds"].default
STABLE_WINDOW_S = 60.0       # KPA's stable window: up and down follow the offered load averaged this long
TREND_WINDOW_S = 20.0        # a burst's rise is measured over this long (4 ticks of 5 s) ...
TREND_CAP = 2.0              # ... and projected at most to this multiple of the load now
DEFAULT_LEAD_S = 60.0        # a new group's start-up until the operator measured one (docs: the assumption)
#: only ever raises the load: TTFTs above the prediction show costs the forward times miss (dispatch,
#: tokenizing, prefetch stalls); TTFTs below it say the queue model is pessimistic, not that capacity is larger
CORRECTION_BOUNDS = (1.0, 2.0)
CORRECTION_MIN_WEIGHT = 20.0  # requests behind the correction before it is trusted
MIN_WAIT_SHARE = 0.25        # the wait budget never drops below a quarter of the TTFT target


class ScaleReason(StrEnum):
    SCALE_UP = "ScaleUp"            # the load asked for more groups for the up window
    PANIC = "PanicScaleUp"          # a burst: scaled up at once
    SCALE_DOWN = "ScaleDown"        # the load fitted fewer groups with margin for the down window
    HOLD = "Hold"                   # the load fits the fleet
    STABILIZING = "Stabilizing"     # a change is asked for, not yet for its whole window
    NO_SIGNAL = "NoSignal"          # no serving pod measured anything yet
    BOUNDS = "Bounds"               # numGroups outside [minGroups, maxGroups]: moved inside


@dataclass(frozen=True)
class QueueShape:
    """How the fleet's ranks queue: ``ranks_per_queue`` None = one pooled queue (endpoint picker)."""

    ranks_per_group: int
    ranks_per_queue: int | None

    @classmethod
    def of(cls, spec: DwdpGroupSpec) -> "QueueShape":
        return cls(ranks_per_group=spec.dwdpSize, ranks_per_queue=None if spec.inferencePool else spec.gpusPerPod)


@dataclass(frozen=True)
class Recommendation:
    at: float
    up: int
    down: int
    offered: float = 0.0   # the signal's offered load then (the stable window's average is made of these)


@dataclass(frozen=True)
class ScaleHistory:
    """What the law remembers between ticks (the operator keeps one per DwdpGroup, in memory)."""

    recommendations: tuple[Recommendation, ...] = ()
    panic_until: float | None = None
    since: float | None = None      # first tick: a down window must be covered by history

    def recorded(self, rec: Recommendation, keep_s: float) -> "ScaleHistory":
        kept = tuple(r for r in self.recommendations if r.at >= rec.at - keep_s) + (rec,)
        return replace(self, recommendations=kept, since=self.since if self.since is not None else rec.at)


@dataclass(frozen=True)
class Decision:
    desired: int
    current: int
    reason: ScaleReason
    message: str
    history: ScaleHistory
    signals: FleetSignals = field(default_factory=FleetSignals)
    up: int | None = None
    down: int | None = None
    load: float | None = None
    wait_budget_s: float | None = None

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def status(self) -> dict[str, Any]:
        """``status.autoscaling`` (the times are the reconciler's to add)."""
        out: dict[str, Any] = {"desiredGroups": self.desired, "reason": str(self.reason), "message": self.message,
                               "signals": self.signals.summary()}
        for key, value in (("recommendedUp", self.up), ("recommendedDown", self.down)):
            if value is not None:
                out[key] = value
        if self.load is not None:
            out["loadErlangs"] = float(f"{self.load:.3g}")
        if self.wait_budget_s is not None:
            out["waitBudgetSeconds"] = float(f"{self.wait_budget_s:.3g}")
        return out


@register_check
def autoscaling_errors(spec: DwdpGroupSpec) -> list[str]:
    a = spec.autoscaling
    if a is None:
        return []
    out = []
    if a.minGroups > a.maxGroups:
        out.append(f"spec.autoscaling.minGroups={a.minGroups} is above spec.autoscaling.maxGroups={a.maxGroups}; "
                   f"raise maxGroups or lower minGroups")
    if a.targetTTFTSeconds is None and a.targetQueueSeconds is None:
        out.append("spec.autoscaling: set targetTTFTSeconds (time to first token) and/or targetQueueSeconds "
                   "(queue wait): the autoscaler sizes the fleet for it")
    return out


def wait_budget(policy: Autoscaling, forward_s: float | None) -> float:
    """Step 2: how long a request may wait for a forward."""
    budgets = []
    if policy.targetQueueSeconds is not None:
        budgets.append(policy.targetQueueSeconds)
    if policy.targetTTFTSeconds is not None:
        t = policy.targetTTFTSeconds
        budgets.append(max(t - (forward_s or 0.0), MIN_WAIT_SHARE * t))
    return min(budgets) if budgets else 1.0


def correction(signals: FleetSignals) -> float:
    if signals.correction is None or signals.correction_weight < CORRECTION_MIN_WEIGHT:
        return 1.0
    lo, hi = CORRECTION_BOUNDS
    return min(hi, max(lo, signals.correction))


def projected(history: ScaleHistory, offered: float, *, now: float, lead_s: float) -> float:
    """The offered load ``lead_s`` from now if it keeps rising as over the last TREND_WINDOW_S (Dynamo's
    planner predicts load too; a linear trend is the simplest predictor): never below the load now, never
    above TREND_CAP times it."""
    past = [r for r in history.recommendations if r.at >= now - TREND_WINDOW_S]
    if not past or now - past[0].at <= 0:
        return offered
    slope = (offered - past[0].offered) / (now - past[0].at)
    return min(TREND_CAP * offered, offered + max(0.0, slope) * lead_s)


def recommend(signals: FleetSignals, policy: Autoscaling, shape: QueueShape, *,
              stable_offered: float | None = None, burst_offered: float | None = None
              ) -> tuple[int, int, int, float, float]:
    """Steps 1-3: (groups for a burst, groups up, groups down, load in erlangs, wait budget); signals must be
    measured. ``stable_offered``: the offered load averaged over ``STABLE_WINDOW_S`` (KPA's stable window;
    default: the signal's own) — the up and down recommendations use it, the burst one the signal's
    fast value. The backlog term adds at most the offered load again (it may double the fleet, no more:
    groups beyond that are Ready after the doubled fleet cleared the queue) and never to ``down``: the
    groups a queue asked for go once it is gone and the panic hold passed."""
    corr = correction(signals)
    fast = corr * (signals.offered_load or 0.0 if burst_offered is None else burst_offered)
    stable = corr * (signals.offered_load or 0.0) if stable_offered is None else corr * stable_offered
    extra = corr * (signals.backlog_seconds or 0.0) / BACKLOG_HORIZON_S
    budget = wait_budget(policy, signals.forward_seconds)

    def groups(erlangs: float) -> int:
        ranks = servers_for(erlangs, wait_s=budget, service_s=signals.forward_seconds, miss=MISS,
                            ranks_per_queue=shape.ranks_per_queue, cv=signals.forward_cv)
        return math.ceil(ranks / shape.ranks_per_group)

    load = stable + min(extra, stable)
    return groups(fast + min(extra, fast)), groups(load), groups(stable * (1 + DOWN_MARGIN)), load, budget


def decide(signals: FleetSignals, history: ScaleHistory, policy: Autoscaling, shape: QueueShape, *,
           current: int, now: float, lead_s: float = DEFAULT_LEAD_S) -> Decision:
    """``lead_s``: how long a new group takes to be Ready (the operator measures it); a burst is sized for
    the load expected then."""
    lo, hi = policy.minGroups, policy.maxGroups
    clamp = min(hi, max(lo, current))
    if signals.offered_load is None:
        hist = replace(history, since=history.since if history.since is not None else now)
        if clamp != current:
            return Decision(clamp, current, ScaleReason.BOUNDS, _bounds_msg(current, policy), hist, signals)
        return Decision(current, current, ScaleReason.NO_SIGNAL, "no serving pod has measured its prefill "
                        "throughput yet: holding", hist, signals)
    window = [r.offered for r in history.recommendations if r.at > now - STABLE_WINDOW_S] + [signals.offered_load]
    stable = sum(window) / len(window)
    burst, up, down, load, budget = recommend(signals, policy, shape, stable_offered=stable)
    burst, up, down = (min(hi, max(lo, g)) for g in (burst, up, down))
    keep = max(policy.scaleUpStabilizationSeconds, policy.scaleDownStabilizationSeconds, policy.panicHoldSeconds,
               STABLE_WINDOW_S)
    hist = history.recorded(Recommendation(now, up, down, signals.offered_load), keep)
    drain = signals.drain_seconds
    panic = burst > current and (burst >= PANIC_RATIO * max(current, 1)
                                 or (drain is not None and drain > PANIC_DRAIN_RATIO * budget))
    if panic:  # sized for the load expected once new groups are Ready (a rise, projected: ``projected``)
        hist = replace(hist, panic_until=now + policy.panicHoldSeconds)
        ahead = projected(history, signals.offered_load, now=now, lead_s=lead_s)
        burst = min(hi, max(burst, recommend(signals, policy, shape, stable_offered=stable, burst_offered=ahead)[0]))
    common = dict(history=hist, signals=signals, up=max(up, burst) if panic else up, down=down, load=load,
                  wait_budget_s=budget)
    why = (f"load {load:.3g} rank-s/s (offered {signals.offered_load:.3g} now, {window and sum(window) / len(window):.3g} "
           f"over {STABLE_WINDOW_S:g}s; backlog {signals.backlog_seconds or 0:.3g} rank-s), wait budget {budget:.3g}s: "
           f"{up} group(s) to scale up, {down} to stay down")
    if clamp != current:
        return Decision(clamp, current, ScaleReason.BOUNDS, _bounds_msg(current, policy), **common)
    if panic:
        desired = min(burst, current + policy.maxStep)
        return Decision(desired, current, ScaleReason.PANIC, f"burst: {why}; {burst} group(s) now", **common)
    up_window = [r.up for r in hist.recommendations if r.at >= now - policy.scaleUpStabilizationSeconds]
    if min(up_window) > current:
        desired = min(min(up_window), current + policy.maxStep)
        return Decision(desired, current, ScaleReason.SCALE_UP,
                        f"{why}; asked for {policy.scaleUpStabilizationSeconds:g}s", **common)
    if up > current:
        return Decision(current, current, ScaleReason.STABILIZING, f"{why}; scale-up waits until the load asked "
                        f"for it {policy.scaleUpStabilizationSeconds:g}s", **common)
    # the stable window lags a load that came back: the load now must fit the smaller fleet too
    down_now = min(hi, max(lo, recommend(signals, policy, shape)[2]))
    down_window = [r.down for r in hist.recommendations if r.at >= now - policy.scaleDownStabilizationSeconds]
    down_window.append(down_now)
    if max(down_window) >= current:
        return Decision(current, current, ScaleReason.HOLD, why, **common)
    if hist.panic_until is not None and now < hist.panic_until:
        return Decision(current, current, ScaleReason.STABILIZING, f"{why}; no scale-down within "
                        f"{policy.panicHoldSeconds:g}s of a burst", **common)
    if hist.since is None or hist.since > now - policy.scaleDownStabilizationSeconds:
        return Decision(current, current, ScaleReason.STABILIZING, f"{why}; scale-down waits for "
                        f"{policy.scaleDownStabilizationSeconds:g}s of history", **common)
    desired = max(max(down_window), current - policy.maxStep)
    return Decision(desired, current, ScaleReason.SCALE_DOWN,
                    f"{why}; fitted {desired} group(s) with {DOWN_MARGIN:.0%} margin for "
                    f"{policy.scaleDownStabilizationSeconds:g}s", **common)


def _bounds_msg(current: int, policy: Autoscaling) -> str:
    return (f"numGroups={current} is outside spec.autoscaling [minGroups={policy.minGroups}, "
            f"maxGroups={policy.maxGroups}]: moved inside")
