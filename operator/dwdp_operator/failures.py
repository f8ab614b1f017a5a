"""What counts as a failure of one group's current attempt — pure rules over the observed pods.

``group_failures`` lists, in a fixed order (pods by name, then a placement dead end, then missing pods),
each naming its pod's index and uid (``Failure.pod``; ``degrade.decide`` reads them):
  * a pod deleted under the group once the gang was complete (before that it is a pod of an unfinished
    gang, e.g. a roll-back, and is re-created once gone: ``desired`` invariant 2);
  * a pod that ended (Failed/Succeeded) or whose container restarted;
  * a placement dead end: some pods bound, another unschedulable for ``restartPolicy.unschedulableSeconds``
    (the bound ones pin the NVLink clique, so waiting cannot help);
  * a pod missing after ``gangComplete`` — decided by the status, never by the pods' gang label (a whole
    gang is labelled complete before it exists).
"""

from __future__ import annotations

from . import manifests as M
from .spec import DwdpGroupSpec
from .state import Failure, FailureKind, GroupStatus
from .status import parse_iso


def group_failures(spec: DwdpGroupSpec, name: str, st: GroupStatus, cur: list[dict], *, now: float) -> list[Failure]:
    """The failures of group ``st`` given its current attempt's pods ``cur`` (see the module docstring)."""
    out = []
    index = {M.pod_name(name, st.index, i): i for i in range(spec.pods_per_group)}
    for p in sorted(cur, key=lambda p: p["name"]):
        at = {"pod": index.get(p["name"]), "uid": p.get("uid", "")}
        if p["deleting"]:
            if st.gangComplete:
                out.append(Failure(FailureKind.POD_DELETED, f"pod {p['name']} deleted", **at))
        elif p["phase"] in ("Failed", "Succeeded"):
            out.append(Failure(FailureKind.POD_ENDED, f"pod {p['name']} {p['phase']}", **at))
        elif p["restarts"] > 0:
            out.append(Failure(FailureKind.CONTAINER_RESTARTED,
                               f"pod {p['name']} container restarted ({p['restarts']}x)", **at))
    dead_end = placement_dead_end(spec, cur, now=now)
    if dead_end:
        out.append(dead_end)
    if st.gangComplete:
        have = {p["name"] for p in cur}
        for i in range(spec.pods_per_group):
            n = M.pod_name(name, st.index, i)
            if n not in have:
                out.append(Failure(FailureKind.POD_DISAPPEARED, f"pod {n} disappeared", pod=i))
    return out


def unschedulable_since(spec: DwdpGroupSpec, cur: list[dict], *, now: float) -> tuple[list[str], float | None]:
    """(nodes the group's bound pods hold, since when another pod has been unschedulable) or ([], None)."""
    bound = sorted({p["node"] for p in cur if p["node"] and not p["deleting"]})
    stuck = [p for p in cur if not p["node"] and p.get("unschedulable_since")]
    if not spec.restartPolicy.unschedulableSeconds or not bound or not stuck:
        return [], None
    return bound, min(parse_iso(p["unschedulable_since"]) or now for p in stuck)


def placement_dead_end(spec: DwdpGroupSpec, cur: list[dict], *, now: float) -> Failure | None:
    """A group split between bound pods and a pod no node can take (the bound ones pin the clique)."""
    bound, since = unschedulable_since(spec, cur, now=now)
    if since is None or now - since < spec.restartPolicy.unschedulableSeconds:
        return None
    stuck = next(p for p in cur if not p["node"] and p.get("unschedulable_since"))
    return Failure(FailureKind.PLACEMENT_DEAD_END,
                   f"placement dead end: pod {stuck['name']} unschedulable for {now - since:.0f}s while the "
                   f"group's other pods hold {', '.join(bound)}; restarting away from those nodes")
