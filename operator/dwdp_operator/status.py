"""Pure status helpers: timestamps, conditions, the summary state and the aggregate fields of
``DwdpGroup.status``.

Invariants:
  1. A condition's ``lastTransitionTime`` changes only when its ``status`` changes.
  2. ``aggregate`` derives replicas/readyGroups/degradedGroups/readyRanks/totalRestarts from ``groups[]``
     alone, so the
     printer columns and the scale subresource can never disagree with the per-group entries.
  3. Conditions (``state.ConditionType``): Ready (every desired group Ready), Progressing (a group
     is being created, restarted, rolled or drained), Degraded (a group is restarting or Failed, or serves
     without lost pods under failurePolicy Degrade: reason RanksMissing when nothing else is wrong),
     Invalid (the spec breaks a rule; children untouched), ChildrenAccepted (False while the API
     server refuses a child: the reason names the kind and the cause, the message the fix).
  4. ``summarize`` is the only place that ranks conditions into ``status.state`` / ``status.reason``
     (the STATUS and REASON printer columns): Invalid > Blocked > Degraded > Progressing > Ready.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable

from . import labels as L
from .sizing import sizing_status
from .spec import DwdpGroupSpec
from .state import BUSY_PHASES, ConditionType, DwdpState, GroupPhase, GroupStatus, Reason


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        try:
            return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None


def condition(old: list[dict] | None, *, type: str, status: bool, reason: str, message: str,
              now: float, generation: int | None) -> dict[str, Any]:
    s = "True" if status else "False"
    prev = next((c for c in (old or []) if c.get("type") == type), None)
    when = prev.get("lastTransitionTime") if prev and prev.get("status") == s and prev.get("lastTransitionTime") else iso(now)
    out = {"type": str(type), "status": s, "reason": str(reason), "message": message, "lastTransitionTime": when}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def aggregate(groups: list[GroupStatus], *, num_groups: int, gpus_per_pod: int = 1) -> dict[str, int]:
    live = [g for g in groups if g.index < num_groups]
    return {
        "replicas": len(live),
        "readyGroups": sum(1 for g in live if g.phase == GroupPhase.READY),
        "degradedGroups": sum(1 for g in live if g.phase == GroupPhase.DEGRADED),
        # a Degraded group serves with the ranks of its Ready pods only (reduced capacity, never "full")
        "readyRanks": sum(g.readyPods for g in live if g.phase in (GroupPhase.READY, GroupPhase.DEGRADED))
        * gpus_per_pod,
        "totalRestarts": sum(g.groupRestarts for g in groups),
    }


def accepted_condition(refusals: Iterable[dict], *, old: list[dict] | None, now: float,
                       generation: int | None) -> dict[str, Any]:
    """ChildrenAccepted from ``status.refusals`` (``refusals.Refusal`` dumps)."""
    refusals = list(refusals)
    if not refusals:
        return condition(old, type=ConditionType.CHILDREN_ACCEPTED, status=True, reason=Reason.ALL_ACCEPTED,
                         message="the API server accepted every child object", now=now, generation=generation)
    return condition(old, type=ConditionType.CHILDREN_ACCEPTED, status=False, reason=refusals[0]["reason"],
                     message="; ".join(r["message"] for r in refusals), now=now, generation=generation)


def conditions_for(groups: list[GroupStatus], *, num_groups: int, outdated: int, refusals: Iterable[dict],
                   old: list[dict] | None, now: float, generation: int | None) -> list[dict]:
    live = [g for g in groups if g.index < num_groups]
    ready = sum(1 for g in live if g.phase == GroupPhase.READY)
    busy = [g for g in groups if g.phase in BUSY_PHASES]
    failed = [g.index for g in groups if g.phase == GroupPhase.FAILED]
    restarting = [g.index for g in groups if g.phase == GroupPhase.RESTARTING]
    short = [g for g in live if g.phase == GroupPhase.DEGRADED]
    all_ready = ready == num_groups and len(live) == num_groups
    progressing = bool(busy) or outdated > 0 or len(live) != num_groups
    degraded = bool(failed or restarting or short)
    if degraded:
        parts = []
        if failed:
            parts.append(f"groups {failed} Failed (restart budget spent; change the template to retry)")
        if restarting:
            parts.append(f"groups {restarting} restarting after backoff")
        parts += [degraded_message(g) for g in short]
        deg_msg = "; ".join(parts)
    else:
        deg_msg = "no group is failing"
    prog_msg = (f"{len(busy)} group(s) in progress, {outdated} outdated" if progressing
                else "every group matches the spec")
    c = ConditionType
    return [
        condition(old, type=c.READY, status=all_ready,
                  reason=Reason.ALL_GROUPS_READY if all_ready else Reason.GROUPS_NOT_READY,
                  message=f"{ready}/{num_groups} groups ready" + (f", {len(short)} degraded (serving with fewer ranks)"
                                                               if short else ""), now=now, generation=generation),
        condition(old, type=c.PROGRESSING, status=progressing,
                  reason=Reason.RECONCILING if progressing else Reason.COMPLETE, message=prog_msg, now=now,
                  generation=generation),
        condition(old, type=c.DEGRADED, status=degraded,
                  reason=(Reason.GROUP_FAILURES if failed or restarting else Reason.RANKS_MISSING) if degraded
                  else Reason.HEALTHY, message=deg_msg, now=now, generation=generation),
        condition(old, type=c.INVALID, status=False, reason=Reason.VALID, message="spec passes every rule",
                  now=now, generation=generation),
        accepted_condition(refusals, old=old, now=now, generation=generation),
    ]


def degraded_message(g: GroupStatus) -> str:
    """One Degraded group in the condition's message: the missing ranks, why, the coverage left."""
    why = "; ".join(f"pod {lp.pod}: {lp.reason}" for lp in g.lostPods or ())
    return (f"group {g.index} serving without ranks {g.missingRanks or []} ({why}); coverage {g.coverage} "
            f"(fewest surviving holders of an expert); recreating the lost pod(s)")


def object_status(spec: DwdpGroupSpec, groups: list[GroupStatus], *, name: str, thash: str, old: dict[str, Any],
                  now: float, generation: int | None) -> dict[str, Any]:
    """``status`` of a valid DwdpGroup with these group entries; ``old``: the status read (previous
    conditions, the refusals carried over untouched, the InferencePool to forget)."""
    still_outdated = sum(1 for g in groups if g.templateHash != thash and g.index < spec.numGroups)
    conditions = conditions_for(groups, num_groups=spec.numGroups, outdated=still_outdated,
                                refusals=old.get("refusals") or [], old=old.get("conditions"), now=now,
                                generation=generation)
    status = {
        "observedGeneration": generation,
        **aggregate(groups, num_groups=spec.numGroups, gpus_per_pod=spec.gpusPerPod),
        "selector": L.selector(name), "templateHash": thash, "groups": [g.to_status() for g in groups],
        "refusals": list(old.get("refusals") or []), "conditions": conditions, **summarize(conditions),
    }
    if spec.inferencePool is not None:
        status["inferencePool"] = name  # what to delete once the spec stops asking for it
    elif old.get("inferencePool"):
        status["inferencePool"] = None  # a merge patch: null removes the key
    sized = sizing_status(spec)
    if sized is not None:
        status["sizing"] = sized
    return status


def invalid_conditions(errors: list[str], *, old: list[dict] | None, now: float,
                       generation: int | None) -> list[dict]:
    """Conditions of a DwdpGroup whose spec breaks a rule: Invalid=True with every message."""
    msg = "; ".join(errors)
    keep = [c for c in (old or []) if c.get("type") in (ConditionType.PROGRESSING, ConditionType.DEGRADED)]
    return keep + [
        condition(old, type=ConditionType.READY, status=False, reason=Reason.INVALID_SPEC,
                  message="spec is invalid; see Invalid", now=now, generation=generation),
        condition(old, type=ConditionType.INVALID, status=True, reason=Reason.INVALID_SPEC, message=msg, now=now,
                  generation=generation),
    ]


def summarize(conditions: list[dict]) -> dict[str, str]:
    """``{"state", "reason"}`` for the printer columns (invariant 4)."""
    by = {c.get("type"): c for c in conditions}

    def true(t: ConditionType) -> bool:
        return (by.get(t) or {}).get("status") == "True"

    accepted = by.get(ConditionType.CHILDREN_ACCEPTED)
    if true(ConditionType.INVALID):
        state, cond = DwdpState.INVALID, by[ConditionType.INVALID]
    elif accepted is not None and accepted.get("status") == "False":
        state, cond = DwdpState.BLOCKED, accepted
    elif true(ConditionType.DEGRADED):
        state, cond = DwdpState.DEGRADED, by[ConditionType.DEGRADED]
    elif true(ConditionType.PROGRESSING) or not true(ConditionType.READY):
        state, cond = DwdpState.PROGRESSING, by.get(ConditionType.READY) or {}
    else:
        state, cond = DwdpState.READY, by[ConditionType.READY]
    return {"state": str(state), "reason": str(cond.get("reason") or "")}


def with_refusals(status: dict[str, Any], refusals: list[dict], *, now: float) -> dict[str, Any] | None:
    """The status after apply's answer: ``refusals`` recorded, ChildrenAccepted and the summary
    re-derived; ``None`` when nothing changed (no write)."""
    if list(status.get("refusals") or []) == refusals:
        return None
    old = status.get("conditions") or []
    gen = status.get("observedGeneration")
    conditions = [c for c in old if c.get("type") != ConditionType.CHILDREN_ACCEPTED]
    conditions.append(accepted_condition(refusals, old=old, now=now, generation=gen))
    return {**status, "refusals": refusals, "conditions": conditions, **summarize(conditions)}
