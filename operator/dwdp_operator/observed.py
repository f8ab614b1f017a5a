"""What the operator observes about its pods: a slim, JSON-able view of a Pod (kept in the kopf index).

Invariant: ``slim_pod`` is total (never raises on a partial Pod body) and keeps only what
``desired_state`` reads, so the index stays small and the pure core never sees raw API objects.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import labels as L


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    st = body.get("status") or {}
    cstats = st.get("containerStatuses") or []
    conds = {c.get("type"): c.get("status") for c in (st.get("conditions") or [])}
    sched = next((c for c in (st.get("conditions") or []) if c.get("type") == "PodScheduled"), {})
    unschedulable = sched.get("status") == "False" and sched.get("reason") == "Unschedulable"
    labels = dict(meta.get("labels") or {})
    return {
        "name": meta.get("name", ""),
        "uid": meta.get("uid", ""),
        "labels": labels,
        "group": _int(labels.get(L.GROUP)),
        "attempt": _int(labels.get(L.ATTEMPT)),
        "deleting": bool(meta.get("deletionTimestamp")),
        "phase": st.get("phase") or "Pending",
        "ready": conds.get("Ready") == "True",
        "restarts": sum(int(c.get("restartCount") or 0) for c in cstats),
        "ip": st.get("podIP") or "",
        "node": spec.get("nodeName") or "",
        # since when the scheduler has found no node for it ("" when it is not unschedulable)
        "unschedulable_since": (sched.get("lastTransitionTime") or "") if unschedulable else "",
    }


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None
