"""The autoscaler's adapter: per DwdpGroup, read the pods' ``/v1/load``, run the law, say what to write.

Called by the reconciler on every pass (``observe``); it decides at most every
``spec.autoscaling.intervalSeconds`` (``Tick.wake`` tells the reconciler when the next decision is due) and
otherwise only reads the draining groups' pods. It writes nothing itself: the reconciler writes numGroups
through the scale subresource (``Applier.scale``), ``status.autoscaling`` with the pass's status, and the
Events.

Invariants:
  1. One law: ``autoscale.decide``, fed with ``autoscale_signals.combine`` of the serving groups' reports
     (groups with index < numGroups); the same functions ``bench/fleet_sim.py`` runs.
  2. numGroups is the autoscaler's while ``spec.autoscaling`` is set: a numGroups that differs from its last
     decision (``status.autoscaling.desiredGroups``) was set by someone else (``kubectl scale``, an HPA, an
     edit) — the next decision starts from it and a Warning Event ``ManualScaleOverridden`` says so and
     how to scale by hand. Without ``spec.autoscaling`` nothing here writes: kubectl scale and an HPA own
     numGroups (the scale subresource).
  3. ``Tick.busy_groups``: the draining groups (index >= numGroups) whose pods still report waiting or
     running prompt tokens; the plan keeps them until they are idle (``desired``: a scale-down never cuts
     an in-flight prefill), bounded by ``desired.DRAIN_BUSY_CAP_S``.
  4. The law sizes a burst for the load expected when new groups are Ready: the lead is measured here, as
     the time groups take from Pending to Ready in status (smoothed; ``DEFAULT_LEAD_S`` until one was seen).
  5. The history lives in memory per DwdpGroup (``forget`` on deletion); after an operator restart the law
     starts with none, which only delays scale-downs (a down window must be covered again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from dwdp_runtime.load.schema import LoadReport

from .autoscale import DEFAULT_LEAD_S, Decision, QueueShape, ScaleHistory, decide
from .autoscale_signals import combine
from .load_reader import LoadReader
from .spec import DwdpGroupSpec, parse_spec
from .state import EventReason, EventType, PlannedEvent
from .status import iso


@dataclass
class Tick:
    decision: Decision | None = None
    status: dict[str, Any] | None = None          # status.autoscaling (None: leave as is)
    events: list[PlannedEvent] = field(default_factory=list)
    busy_groups: frozenset[int] = frozenset()
    wake: float | None = None                     # seconds to the next decision


#: weight of the newest group start-up in the measured lead (an average over the last few)
LEAD_SMOOTHING = 0.3


@dataclass
class _Memory:
    history: ScaleHistory = field(default_factory=ScaleHistory)
    next_at: float = float("-inf")
    starting: dict[int, float] = field(default_factory=dict)   # group index -> first seen not Ready
    lead_s: float | None = None                                 # measured start-up: not Ready -> Ready

    def observe_groups(self, status: dict, now: float) -> None:
        """Group start-ups from the phases in status: the lead the law sizes a burst for."""
        for g in status.get("groups") or []:
            idx, phase = g.get("index"), g.get("phase")
            if phase == "Ready":
                started = self.starting.pop(idx, None)
                if started is not None:
                    sample = now - started
                    self.lead_s = sample if self.lead_s is None else (
                        LEAD_SMOOTHING * sample + (1 - LEAD_SMOOTHING) * self.lead_s)
            elif phase == "Pending":
                self.starting.setdefault(idx, now)


class Autoscaler:
    def __init__(self, reader: LoadReader | None = None):
        self.reader = reader or LoadReader()
        self._memory: dict[Hashable, _Memory] = {}

    def forget(self, key: Hashable) -> None:
        self._memory.pop(key, None)

    def observe(self, key: Hashable, cr: dict, pods: list[dict], *, port: int, namespace: str, now: float) -> Tick:
        spec, errors = parse_spec(cr.get("spec"))
        if spec is None or errors:
            return Tick()
        old = (cr.get("status") or {}).get("autoscaling")
        policy = spec.autoscaling
        mem = self._memory.get(key)
        due = policy is not None and (mem is None or now >= mem.next_at)
        serving = [p for p in pods if p.get("group") is not None and p["group"] < spec.numGroups]
        draining = [p for p in pods if p.get("group") is not None and p["group"] >= spec.numGroups]
        reports = self.reader.read((serving if due else []) + draining, port=port, namespace=namespace)
        busy = busy_groups(draining, reports)
        if policy is None:
            self.forget(key)
            return Tick(status={} if old else None, busy_groups=busy)  # {}: the reconciler removes the key
        mem = self._memory.setdefault(key, _Memory())
        mem.observe_groups(cr.get("status") or {}, now)
        if not due:
            return Tick(busy_groups=busy, wake=max(0.0, mem.next_at - now))
        mem.next_at = now + policy.intervalSeconds
        decision = decide(combine(reports[p["uid"]] for p in serving if p["uid"] in reports), mem.history, policy,
                          QueueShape.of(spec), current=spec.numGroups, now=now,
                          lead_s=mem.lead_s if mem.lead_s is not None else DEFAULT_LEAD_S)
        mem.history = decision.history
        return Tick(decision=decision, status=decision_status(decision, old, now=now),
                    events=decision_events(decision, old, spec), busy_groups=busy, wake=policy.intervalSeconds)


def busy_groups(draining: list[dict], reports: dict[str, LoadReport]) -> frozenset[int]:
    """Draining groups with prompt tokens still waiting or running on any of their pods (invariant 3)."""
    return frozenset(p["group"] for p in draining if p["uid"] in reports
                     and reports[p["uid"]].waiting_prefill_tokens + reports[p["uid"]].running_prefill_tokens > 0)


def decision_status(d: Decision, old: dict | None, *, now: float) -> dict[str, Any]:
    out = {**d.status(), "currentGroups": d.current, "lastDecisionTime": iso(now)}
    last = iso(now) if d.changed else (old or {}).get("lastScaleTime")
    if last:
        out["lastScaleTime"] = last
    return out


def decision_events(d: Decision, old: dict | None, spec: DwdpGroupSpec) -> list[PlannedEvent]:
    out = []
    previous = (old or {}).get("desiredGroups")
    if previous is not None and previous != spec.numGroups:
        out.append(PlannedEvent(EventType.WARNING, EventReason.MANUAL_SCALE_OVERRIDDEN,
                                f"spec.numGroups was set to {spec.numGroups} outside the autoscaler (its last "
                                f"decision: {previous}); while spec.autoscaling is set the autoscaler owns "
                                f"numGroups and decides from {spec.numGroups} now. To scale by hand (kubectl "
                                f"scale, an HPA), remove spec.autoscaling"))
    if d.changed:
        reason = EventReason.AUTOSCALE_UP if d.desired > d.current else EventReason.AUTOSCALE_DOWN
        out.append(PlannedEvent(EventType.NORMAL, reason,
                                f"numGroups {d.current} -> {d.desired} ({d.reason}): {d.message}"))
    return out
