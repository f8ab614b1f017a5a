"""``spec.failurePolicy: Degrade`` — which failures a running group can absorb by recreating only the failed
pods, and the spec rule that makes that possible. Pure: no I/O, no clock (``now`` is an argument).

A pod i of a group runs the ranks ``[i*gpusPerPod, (i+1)*gpusPerPod)`` (``pod_ranks``). The experts those
ranks held survive on other ranks when ``experts.replicas`` r > 1 (``dwdp_runtime.layout.holder_layout``:
rank j also stores its r-1 ring predecessors' experts); the runtime's own test of survival is
``dwdp_runtime.membership.group_survives`` and the operator asks exactly that, never a copy of it.

Invariants:
  1. Under ``RestartGroup`` every failure restarts the group (today's path, unchanged): ``decide`` says
     ``RESTART_GROUP`` and the caller never consults the rest.
  2. Under ``Degrade`` a failure is absorbed (``RECREATE_PODS``) only when all of these hold, else the group
     restarts and ``Decision.reason`` says which failed: every failure names its pod (a placement dead end is
     the group's); the group was serving (phase Ready or Degraded with its gang complete: a replacement needs
     a running group to rejoin); the ranks of every lost pod — those already being recreated and the new
     ones — leave every expert a surviving holder (``group_survives``); and the pods recreated alone within
     ``degrade.windowSeconds`` plus the new ones stay within ``degrade.maxPodRecreations``.
  3. ``fresh_failures`` drops what the recreation itself causes (the failed pod, recorded by uid in
     ``lostPods``, being deleted or gone), so recreating a pod is never mistaken for another loss; a
     replacement (another uid) that fails is a new loss of that pod and counts against the budget.
  4. ``pod_loss_errors`` (a ``validate_spec`` check) refuses ``Degrade`` when the loss of some single pod
     already loses an expert; for the layouts the sharding rules admit that is exactly
     ``experts.replicas <= gpusPerPod`` (CEL twin: ``crd_extras.SPEC_RULES``; tests/operator/test_op_crd.py
     holds the two to each other): the pod's first rank's leading experts are held by it and its r-1 ring
     successors only, all inside the pod when r <= gpusPerPod.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Iterable

from dwdp_runtime.config import DwdpConfig, sharding_errors
from dwdp_runtime.layout import coverage, uncovered_experts
from dwdp_runtime.membership import group_survives

from .spec import DEGRADE_NEEDS_REPLICAS, DwdpGroupSpec, FailurePolicy, register_check
from .state import Failure, FailureKind, GroupPhase, GroupStatus
from .status import parse_iso

#: the phases of a group that serves (a replacement pod can rejoin it)
SERVING_PHASES = (GroupPhase.READY, GroupPhase.DEGRADED)
#: failures the recreation of a lost pod causes itself (the old pod deleted, then gone) — when of that pod's
#: recorded uid (or, gone, of no uid)
_SELF_CAUSED = (FailureKind.POD_DELETED, FailureKind.POD_DISAPPEARED, FailureKind.POD_ENDED,
                FailureKind.CONTAINER_RESTARTED)


class Action(StrEnum):
    RECREATE_PODS = "RecreatePods"  # delete and recreate only the lost pods, same attempt; the group serves on
    RESTART_GROUP = "RestartGroup"  # today's path: every pod, next attempt, backoff, maxRestarts


@dataclass(frozen=True)
class Decision:
    action: Action
    pods: tuple[int, ...] = ()          # RECREATE_PODS: the pods newly lost (indices)
    lost_ranks: tuple[int, ...] = ()    # every rank missing once they are lost (with those being recreated)
    coverage: int = 0                   # fewest surviving holders of any expert without lost_ranks
    reason: str = ""                    # RESTART_GROUP under Degrade: why Degrade cannot keep the group


def pod_ranks(spec: DwdpGroupSpec, pod: int) -> tuple[int, ...]:
    """The group ranks pod ``pod`` runs (``manifests.worker_env``: DWDP_RANK_BASE = pod * gpusPerPod)."""
    return tuple(range(pod * spec.gpusPerPod, (pod + 1) * spec.gpusPerPod))


def ranks_of(spec: DwdpGroupSpec, pods: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({r for p in pods for r in pod_ranks(spec, p)}))


def runtime_config(spec: DwdpGroupSpec) -> DwdpConfig:
    """The group's layout as the runtime builds it (raises ValueError on a spec the sharding rules refuse)."""
    e = spec.experts
    return DwdpConfig(dwdp_size=spec.dwdpSize, num_experts=e.numExperts, num_experts_per_worker=e.numExpertsPerWorker,
                      num_prefetch_experts=e.numPrefetchExperts, expert_replicas=e.replicas)


def coverage_left(spec: DwdpGroupSpec, lost_ranks: Iterable[int]) -> int:
    """Fewest surviving holders of any expert once ``lost_ranks`` are gone (0: some expert has none)."""
    return coverage(runtime_config(spec).holders(), lost_ranks)


def _runs(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5`` (messages)."""
    out: list[list[int]] = []
    for v in sorted(values):
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def coverage_loss(spec: DwdpGroupSpec, lost_ranks: Iterable[int]) -> str:
    """Why losing ``lost_ranks`` ends the group, or "" when it survives (``group_survives``)."""
    lost = tuple(sorted(set(lost_ranks)))
    config = runtime_config(spec)
    if group_survives(config, lost):
        return ""
    if len(lost) >= spec.dwdpSize:
        return f"every rank of the group is lost (ranks {_runs(lost)})"
    gone = uncovered_experts(config.holders(), lost)
    return (f"coverage lost: without ranks {_runs(lost)} experts {_runs(gone)} have no surviving holder "
            f"(experts.replicas={spec.experts.replicas})")


def recent(times: Iterable[str] | None, *, now: float, window_s: float) -> list[str]:
    """The recreation times still inside the budget's sliding window (unparsable ones dropped)."""
    return [t for t in times or () if (at := parse_iso(t)) is not None and now - at < window_s]


def fresh_failures(st: GroupStatus, failures: list[Failure]) -> list[Failure]:
    """``failures`` less those the recreation of ``st.lostPods`` causes itself (invariant 3)."""
    lost = {lp.pod: lp.uid for lp in st.lostPods or ()}
    return [f for f in failures
            if not (f.pod in lost and f.kind in _SELF_CAUSED and f.uid in ("", lost[f.pod]))]


def decide(spec: DwdpGroupSpec, st: GroupStatus, fresh: list[Failure], *, now: float) -> Decision:
    """What to do about the new failures ``fresh`` (non-empty, from ``fresh_failures``) of group ``st``."""
    if spec.failurePolicy != FailurePolicy.DEGRADE:
        return Decision(Action.RESTART_GROUP)  # invariant 1

    def restart(reason: str) -> Decision:
        return Decision(Action.RESTART_GROUP, reason=f"failurePolicy Degrade falls back to a group restart: {reason}")

    whole = [f for f in fresh if f.pod is None]
    if whole:
        return restart(f"{whole[0].text} is a failure of the group, not of one pod")
    if not st.gangComplete or st.phase not in SERVING_PHASES:
        return restart(f"the group was not serving yet (phase {st.phase}): a replacement has no running group "
                       f"to rejoin")
    new = tuple(sorted({f.pod for f in fresh}))
    lost_pods = sorted({lp.pod for lp in st.lostPods or ()} | set(new))
    lost_ranks = ranks_of(spec, lost_pods)
    why = coverage_loss(spec, lost_ranks)
    if why:
        return restart(why)
    used = len(recent(st.podRecreations, now=now, window_s=spec.degrade.windowSeconds))
    budget = spec.degrade.maxPodRecreations
    if used + len(new) > budget:
        return restart(f"recreation budget spent: {used} pod(s) recreated alone within the last "
                       f"{spec.degrade.windowSeconds}s, {len(new)} more would pass degrade.maxPodRecreations={budget}")
    return Decision(Action.RECREATE_PODS, pods=new, lost_ranks=lost_ranks, coverage=coverage_left(spec, lost_ranks))


@register_check
def pod_loss_errors(spec: DwdpGroupSpec) -> list[str]:
    """Invariant 4: ``Degrade`` needs a layout in which any single pod can be lost."""
    e = spec.experts
    if spec.failurePolicy != FailurePolicy.DEGRADE or sharding_errors(
            dwdp_size=spec.dwdpSize, num_experts=e.numExperts, num_experts_per_worker=e.numExpertsPerWorker,
            num_prefetch_experts=e.numPrefetchExperts, num_prefetch_slots=e.numPrefetchSlots, num_groups=1,
            expert_replicas=e.replicas):
        return []  # RestartGroup, or a sharding the sharding check refuses already
    for pod in range(spec.pods_per_group):
        why = coverage_loss(spec, pod_ranks(spec, pod))
        if why:
            fix = (f"set experts.replicas to {spec.gpusPerPod + 1} or more, or failurePolicy RestartGroup"
                   if spec.gpusPerPod < spec.dwdpSize else
                   "a group in one pod loses every rank with it: use failurePolicy RestartGroup")
            return [f"spec.failurePolicy: {DEGRADE_NEEDS_REPLICAS} (experts.replicas={e.replicas}, "
                    f"gpusPerPod={spec.gpusPerPod}: losing pod {pod} means {why}); {fix}"]
    return []
