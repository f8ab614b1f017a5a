"""Pure status helpers: timestamps, conditions and the aggregate fields of ``DwdpGroup.status``.

Invariants:
  1. A condition's ``lastTransitionTime`` changes only when its ``status`` changes.
  2. ``aggregate`` derives replicas/readyGroups/totalRestarts from ``groups[]`` alone, so the
     printer columns and the scale subresource can never disagree with the per-group entries.
  3. Conditions (DESIGN §5): Ready (every desired group Ready), Progressing (a group is being
     created, restarted, rolled or drained), Degraded (a group is restarting or Failed),
     Invalid (the spec breaks a rule; children untouched).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

BUSY_PHASES = ("Pending", "Restarting", "Updating", "Draining")


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
    out = {"type": type, "status": s, "reason": reason, "message": message, "lastTransitionTime": when}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def aggregate(groups: list[dict], *, num_groups: int) -> dict[str, int]:
    live = [g for g in groups if g["index"] < num_groups]
    return {
        "replicas": len(live),
        "readyGroups": sum(1 for g in live if g.get("phase") == "Ready"),
        "totalRestarts": sum(int(g.get("groupRestarts") or 0) for g in groups),
    }


def conditions_for(groups: list[dict], *, num_groups: int, outdated: int, old: list[dict] | None,
                   now: float, generation: int | None) -> list[dict]:
    live = [g for g in groups if g["index"] < num_groups]
    ready = sum(1 for g in live if g.get("phase") == "Ready")
    busy = [g for g in groups if g.get("phase") in BUSY_PHASES]
    failed = [g["index"] for g in groups if g.get("phase") == "Failed"]
    restarting = [g["index"] for g in groups if g.get("phase") == "Restarting"]
    all_ready = ready == num_groups and len(live) == num_groups
    progressing = bool(busy) or outdated > 0 or len(live) != num_groups
    degraded = bool(failed or restarting)
    if degraded:
        parts = []
        if failed:
            parts.append(f"groups {failed} Failed (restart budget spent; change the template to retry)")
        if restarting:
            parts.append(f"groups {restarting} restarting after backoff")
        deg_msg = "; ".join(parts)
    else:
        deg_msg = "no group is failing"
    prog_msg = (f"{len(busy)} group(s) in progress, {outdated} outdated" if progressing
                else "every group matches the spec")
    return [
        condition(old, type="Ready", status=all_ready, reason="AllGroupsReady" if all_ready else "GroupsNotReady",
                  message=f"{ready}/{num_groups} groups ready", now=now, generation=generation),
        condition(old, type="Progressing", status=progressing,
                  reason="Reconciling" if progressing else "Complete", message=prog_msg, now=now,
                  generation=generation),
        condition(old, type="Degraded", status=degraded, reason="GroupFailures" if degraded else "Healthy",
                  message=deg_msg, now=now, generation=generation),
        condition(old, type="Invalid", status=False, reason="Valid", message="spec passes every rule",
                  now=now, generation=generation),
    ]


def invalid_conditions(errors: list[str], *, old: list[dict] | None, now: float,
                       generation: int | None) -> list[dict]:
    """Conditions of a DwdpGroup whose spec breaks a rule: Invalid=True with every message."""
    msg = "; ".join(errors)
    keep = [c for c in (old or []) if c.get("type") in ("Progressing", "Degraded")]
    return keep + [
        condition(old, type="Ready", status=False, reason="InvalidSpec", message="spec is invalid; see Invalid",
                  now=now, generation=generation),
        condition(old, type="Invalid", status=True, reason="InvalidSpec", message=msg, now=now,
                  generation=generation),
    ]
