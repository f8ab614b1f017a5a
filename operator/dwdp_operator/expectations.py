"""Pods a pass just created or rolled back that the pod informer has not shown yet (the
"expectations" client-go's ReplicaSet controller keeps for the same reason).

Why: the informer delivers the operator's own creates one watch event at a time. A pass that saw 3
of the 4 pods of a gang created whole (labelled complete, desired invariant 2a) would read the 4th
as lost and restart the group; a pass that still saw the pods of a rolled-back gang would do the
same. So the next pass of that DwdpGroup waits until every pod it created is seen and every pod it
rolled back is gone, and it skips the GET and the plan meanwhile (the informer's events wake it).

Invariants:
  1. The wait is bounded by ``until`` (an event that never comes — a pod deleted by someone else in
     between — must not stall the group): past it the pass runs on what the informer shows.
  2. One value per DwdpGroup (the reconciler's key state), replaced by each pass that writes pods,
     dropped once met: nothing grows with the pods ever created.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodExpectation:
    present: frozenset[str]   # created (or already there): must be seen
    absent: frozenset[str]    # rolled back: must be gone (a pod being deleted counts as gone)
    until: float              # monotonic deadline (invariant 1)

    @classmethod
    def after(cls, created: list[str], rolled_back: list[str], *, now: float, wait_s: float) -> "PodExpectation | None":
        if not created and not rolled_back:
            return None
        return cls(frozenset(created) - frozenset(rolled_back), frozenset(rolled_back), now + wait_s)

    def wait(self, pods: list[dict], *, now: float) -> float | None:
        """Seconds the pass should still wait for the informer, or None: go (met, or past ``until``)."""
        if now >= self.until:
            return None
        live = {p["name"] for p in pods if not p.get("deleting")}
        seen = {p["name"] for p in pods}
        if self.present <= seen and not (self.absent & live):
            return None
        return self.until - now
