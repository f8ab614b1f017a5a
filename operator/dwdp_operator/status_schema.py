"""The typed shape of ``DwdpGroup.status`` as the operator writes it: the CRD's status schema is
generated from these models (``crdgen``), descriptions included.

Invariants:
  1. Writing stays plain dicts (``desired.Plan.status`` is a merge patch, where ``None`` removes a
     key); these models describe that dict. The API server prunes any status field its schema does
     not name, silently: ``tests/operator/test_op_crdgen.py`` holds every status ``desired_state`` and
     ``status.with_refusals`` produce to the generated schema, so a new field cannot be lost that way.
  2. Every field is optional but a condition's ``type`` and ``status``: a status written by an
     older operator still fits. ``crdgen`` writes no defaults and no enums under ``status``: the
     schema describes what the operator wrote, it never fills anything in.
  3. The entries reuse the models the operator reads status with (``state.GroupStatus``,
     ``refusals.Refusal``), so a field added there is a field of the CRD.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .refusals import Refusal
from .state import ConditionType, DwdpState, GroupStatus


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Condition(_Model):
    """One entry of ``status.conditions`` (``status.condition`` builds them)."""

    type: str = Field(description="condition type")
    status: str = Field(description="True, False or Unknown")
    reason: str | None = Field(default=None, description="one CamelCase word")
    message: str | None = Field(default=None, description="details and the fix")
    lastTransitionTime: str | None = Field(default=None, description="when status last changed")
    observedGeneration: int | None = Field(default=None, description="the spec generation the condition describes")


class SizingStatus(_Model):
    """``status.sizing`` (``sizing.sizing_status``)."""

    fits: bool | None = Field(default=None, description="the experts and pool slots fit GPU memory")
    message: str | None = Field(default=None, description="the planner's memory breakdown")
    predictedSpeedup: float | None = Field(default=None, description="predicted T_DEP / T_DWDP per MoE layer")
    tDwdpUs: float | None = Field(default=None, description="predicted DWDP time per MoE layer (us)")
    tDepUs: float | None = Field(default=None, description="predicted expert-parallel time per MoE layer (us)")
    isl: int | None = Field(default=None, description="input length of the prediction")


class AutoscalingSignals(_Model):
    """``status.autoscaling.signals``: the fleet's load from the serving pods' ``GET /v1/load``
    (``autoscale_signals``)."""

    pods: int | None = Field(default=None, description="serving pods that reported")
    ranks: int | None = Field(default=None, description="their ready ranks")
    offeredLoad: float | None = Field(default=None, description="rank-seconds of prefill arriving per second")
    backlogSeconds: float | None = Field(default=None, description=(
        "rank-seconds of prefill waiting (and half the running)"))
    drainSeconds: float | None = Field(default=None, description="backlogSeconds / ranks")
    forwardSeconds: float | None = Field(default=None, description="mean forward time")
    ttftEstimateSeconds: float | None = Field(default=None, description="a new request's TTFT now (drain + a forward)")
    ttftObservedSeconds: float | None = Field(default=None, description="mean TTFT of answered requests (decayed)")
    ttftCorrection: float | None = Field(default=None, description="observed / predicted TTFT")
    waitingTokens: int | None = Field(default=None, description="prompt tokens waiting")
    runningTokens: int | None = Field(default=None, description="prompt tokens in a forward")
    saturation: float | None = Field(default=None, description="mean of the pods' saturation, 0..1")


class AutoscalingStatus(_Model):
    """``status.autoscaling``: the autoscaler's last decision (``autoscaler``; spec.autoscaling)."""

    desiredGroups: int | None = Field(default=None, description="numGroups the last decision asked for")
    currentGroups: int | None = Field(default=None, description="numGroups when it decided")
    reason: str | None = Field(default=None, description=(
        "ScaleUp, PanicScaleUp, ScaleDown, Hold, Stabilizing, NoSignal or Bounds"))
    message: str | None = Field(default=None, description="the law's numbers: load, wait budget, the groups it asks for")
    recommendedUp: int | None = Field(default=None, description="groups the load asks for now")
    recommendedDown: int | None = Field(default=None, description="groups that carry the load with the scale-down margin")
    loadErlangs: float | None = Field(default=None, description=(
        "rank-seconds of prefill per second the fleet is sized for (corrected offered load + backlog share)"))
    waitBudgetSeconds: float | None = Field(default=None, description="how long a request may wait for a forward")
    lastDecisionTime: str | None = Field(default=None, description="when it last decided")
    lastScaleTime: str | None = Field(default=None, description="when it last changed numGroups")
    signals: AutoscalingSignals | None = Field(default=None, description=(
        "the fleet's load from the serving pods' GET /v1/load"))


class DwdpGroupStatus(_Model):
    observedGeneration: int | None = Field(default=None, description="the spec generation this status describes")
    state: str | None = Field(default=None, description=(
        f"{', '.join(DwdpState)} (printer column STATUS)"))
    reason: str | None = Field(default=None, description="reason of the condition behind state (printer column REASON)")
    replicas: int | None = Field(default=None, description="groups that exist (any phase but removed)")
    readyGroups: int | None = Field(default=None, description="groups with every pod Running and Ready")
    degradedGroups: int | None = Field(default=None, description=(
        "groups serving without lost pods (failurePolicy Degrade; phase Degraded)"))
    readyRanks: int | None = Field(default=None, description=(
        "ranks in Ready pods of Ready and Degraded groups: the capacity serving now"))
    totalRestarts: int | None = Field(default=None, description="sum of groups[].groupRestarts")
    selector: str | None = Field(default=None, description="label selector of all worker pods (scale subresource)")
    templateHash: str | None = Field(default=None, description="hash of the pod-shaping spec fields")
    inferencePool: str | None = Field(default=None, description=(
        "name of the InferencePool the operator created (deleted once spec.inferencePool is removed)"))
    refusals: list[Refusal] | None = Field(default=None, description=(
        "child objects the API server refuses (one entry per distinct cause; condition ChildrenAccepted)"))
    sizing: SizingStatus | None = Field(default=None, description="the planner's verdict for spec.sizing")
    autoscaling: AutoscalingStatus | None = Field(default=None, description=(
        "the autoscaler's last decision (spec.autoscaling)"))
    groups: list[GroupStatus] | None = Field(default=None, description="one entry per group")
    conditions: list[Condition] | None = Field(default=None, description=(
        f"{', '.join(ConditionType)} (docs/OPERATOR.md lists every reason)"))
