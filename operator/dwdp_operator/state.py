"""Typed DwdpGroup state: the phase of a group, the summary state of the object, why a group failed,
and the models ``status.groups[]`` and ``status.refusals[]`` are read into and written from.

Invariants:
  1. Every phase, state, condition type and reason the operator writes is a member here (a
     ``StrEnum``, so it is also the exact string in the API object); nothing compares free text.
  2. ``GroupStatus`` is frozen: ``desired_state`` derives a new one per pass (``model_copy``) from
     the one read out of the object's status, never edits what it read.
  3. Reading is lenient (unknown fields are ignored, missing ones take defaults: a status written
     by an older operator still parses); writing is ``to_status()``, the CRD's status schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class GroupPhase(StrEnum):
    PENDING = "Pending"        # creating, or not every pod ready
    READY = "Ready"            # every pod Running and Ready
    DEGRADED = "Degraded"      # failurePolicy Degrade: a pod lost, recreated alone; the others keep serving
    RESTARTING = "Restarting"  # failed; waiting for the backoff (restartAt), old pods being deleted
    UPDATING = "Updating"      # rolled to a new template; old pods being deleted
    DRAINING = "Draining"      # scaled away: out of the client Service until drainUntil, then deleted
    FAILED = "Failed"          # restart budget spent; stays down until the template changes


BUSY_PHASES = (GroupPhase.PENDING, GroupPhase.RESTARTING, GroupPhase.UPDATING, GroupPhase.DRAINING)


class DwdpState(StrEnum):
    """``status.state``: one word for ``kubectl get`` (the STATUS column), most severe first."""

    INVALID = "Invalid"          # the spec breaks a rule (condition Invalid)
    BLOCKED = "Blocked"          # the API server refuses a child (condition ChildrenAccepted=False)
    DEGRADED = "Degraded"        # a group is restarting, Failed, or serving without a lost pod (Degrade)
    PROGRESSING = "Progressing"  # groups being created, rolled, drained
    READY = "Ready"              # every desired group Ready


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INVALID = "Invalid"
    CHILDREN_ACCEPTED = "ChildrenAccepted"


class Reason(StrEnum):
    """Condition reasons other than the per-child ``<Kind><Cause>`` of ``refusals.Refusal``."""

    ALL_GROUPS_READY = "AllGroupsReady"
    GROUPS_NOT_READY = "GroupsNotReady"
    RECONCILING = "Reconciling"
    COMPLETE = "Complete"
    GROUP_FAILURES = "GroupFailures"
    RANKS_MISSING = "RanksMissing"  # failurePolicy Degrade: groups serve without lost pods (nothing restarting)
    HEALTHY = "Healthy"
    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"
    ALL_ACCEPTED = "AllAccepted"


class EventReason(StrEnum):
    CREATED = "Created"                # first pass of a new DwdpGroup
    GROUP_CREATED = "GroupCreated"     # a group's new attempt is being created
    GROUP_RESTART = "GroupRestart"
    GROUP_FAILED = "GroupFailed"
    RANK_LOST = "RankLost"             # Degrade: a pod's ranks lost; only that pod is recreated (the message: why)
    RANK_REJOINED = "RankRejoined"     # Degrade: the recreated pod is Ready again (rejoined the running group)
    ROLLING_UPDATE = "RollingUpdate"
    SCALE_UP = "ScaleUp"
    SCALE_DOWN = "ScaleDown"
    INVALID_SPEC = "InvalidSpec"
    RECONCILE_ERROR = "ReconcileError"  # a pass failed on a transient API error (one per distinct error)
    AUTOSCALE_UP = "AutoscaleUp"        # spec.autoscaling raised numGroups (the message: reason and signals)
    AUTOSCALE_DOWN = "AutoscaleDown"    # spec.autoscaling lowered numGroups
    MANUAL_SCALE_OVERRIDDEN = "ManualScaleOverridden"  # numGroups changed by someone else while autoscaling
    AUTOSCALE_FAILED = "AutoscaleFailed"  # the scale subresource write was refused (the message: the fix)


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class PlannedEvent(NamedTuple):
    type: EventType
    reason: str
    message: str


class FailureKind(StrEnum):
    POD_DELETED = "PodDeleted"
    POD_ENDED = "PodEnded"                 # phase Failed or Succeeded (restartPolicy Never)
    CONTAINER_RESTARTED = "ContainerRestarted"
    POD_DISAPPEARED = "PodDisappeared"     # missing after the gang was complete
    PLACEMENT_DEAD_END = "PlacementDeadEnd"


@dataclass(frozen=True)
class Failure:
    """Why a group restarts: ``kind`` drives behaviour, ``text`` is for people; ``pod`` is the failed pod's
    index i (``<name>-g<g>-p<i>``) and ``uid`` its uid ("" for a pod that is gone), None for a failure of the
    group as a whole (a placement dead end)."""

    kind: FailureKind
    text: str
    pod: int | None = None
    uid: str = ""


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class RestartRecord(_Model):
    attempt: int = Field(description="the attempt that failed")
    time: str = Field(description="when")
    reason: str = Field(description="why")


class LostPod(_Model):
    """One entry of ``status.groups[].lostPods`` (failurePolicy Degrade): a pod being recreated alone."""

    pod: int = Field(description="pod index i (<name>-g<g>-p<i>)")
    ranks: list[int] = Field(description="the group ranks it ran (DWDP_RANK_BASE .. + gpusPerPod - 1)")
    uid: str = Field(default="", description="uid of the pod that failed (its replacement has another)")
    reason: str = Field(default="", description="why it was lost")
    since: str = Field(default="", description="when the operator saw it lost")


class GroupStatus(_Model):
    """One entry of ``status.groups``."""

    index: int = Field(description="group index g (pods <name>-g<g>-p<i>)")
    attempt: int = Field(default=0, description="bumped by every restart and rollout (DWDP_ATTEMPT)")
    phase: GroupPhase = Field(default=GroupPhase.PENDING, description=(
        "Pending, Ready, Degraded, Restarting, Updating, Draining or Failed"))
    templateHash: str = Field(default="", description="template of the current attempt")
    gangComplete: bool = Field(default=False, description="every pod of the attempt existed once")
    pods: int = Field(default=0, description="pods of the current attempt")
    readyPods: int = Field(default=0, description="of them Running and Ready")
    podRestarts: int = Field(default=0, description="container restarts of the current pods")
    groupRestarts: int = Field(default=0, description=(
        "group restarts since the last rollout (counted against maxRestarts)"))
    prefetchRestarts: int = Field(default=0, description="sum of the workers' prefetch_restarts (GET /healthz)")
    restartAt: str | None = Field(default=None, description=(
        "when a pending restart or rollout creates the next attempt"))
    drainUntil: str | None = Field(default=None, description="when a draining group's pods are deleted")
    lastRestartTime: str | None = Field(default=None, description="time of the last restart")
    lastRestartReason: str | None = Field(default=None, description="why the group last restarted")
    avoidNodes: list[str] | None = Field(default=None, description=(
        "nodes the next attempt must avoid (left by a placement dead end)"))
    history: list[RestartRecord] = Field(default_factory=list, description="the last 10 restarts")
    lostPods: list[LostPod] | None = Field(default=None, description=(
        "failurePolicy Degrade: pods lost and being recreated alone (absent when the group is whole)"))
    missingRanks: list[int] | None = Field(default=None, description=(
        "failurePolicy Degrade: ranks of lostPods, not serving (absent when the group is whole)"))
    coverage: int | None = Field(default=None, description=(
        "failurePolicy Degrade: fewest surviving holders of any expert without missingRanks (>= 1 while "
        "Degraded; absent when the group is whole: experts.replicas)"))
    podRecreations: list[str] | None = Field(default=None, description=(
        "failurePolicy Degrade: when pods were recreated alone within degrade.windowSeconds (the budget)"))

    def to_status(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def read_groups(status: dict[str, Any]) -> dict[int, GroupStatus]:
    """``status.groups`` as models by index; entries that do not parse are dropped (rebuilt)."""
    out: dict[int, GroupStatus] = {}
    for raw in status.get("groups") or []:
        try:
            g = GroupStatus.model_validate(raw)
        except ValueError:
            continue
        out[g.index] = g
    return out
