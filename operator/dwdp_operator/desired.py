"""``desired_state(cr, pods, now=…)``: the pure core of the operator — observed world in, plan out.

No I/O, no clock (``now`` is an argument), no randomness except the token passed in. Level-
triggered: the plan depends only on the DwdpGroup (spec + the status it wrote last time) and the
pods that exist now, so running it twice, or after an operator restart, gives the same plan.

Per group g the phase machine (``state.GroupPhase``, status.groups[g].phase):

    (new) ──► Pending ──all pods ready──► Ready
                 ▲  ▲                       │ pod Failed/Succeeded/deleted/missing, container restart
                 │  │                       ▼
                 │  └── restartAt passed ◄─ Restarting ◄─(groupRestarts < maxRestarts)
                 │      and no pods left         │
                 │                               └─(budget spent)──► Failed (pods deleted)
                 └── no pods left ◄── Updating ◄── template hash changed (≤ maxUnavailableGroups at once;
                                                   groups already unavailable roll at once)
    g ≥ numGroups: Draining (pods leave the client Service) ──drainUntil, and idle──► pods deleted ──► removed

Invariants:
  1. A new attempt's pods are created only when no pod of the group is left (pod names are reused,
     and a stale rank must never meet a new one); attempt+1 is written to status before any pod of
     it exists (apply writes status first), so a crash never creates two attempts.
  2. ``gangComplete`` (status) is set once every pod of the attempt existed (observed, or created
     by the pass that writes it: invariant 5); after that a missing pod is a failure, even when
     every pod of the group vanished at once. Only the status says so, never the pods' gang label.
     Before it, a missing or terminating pod is no failure: it is (re)created once it is gone.
  2a. Gangs are all or nothing. A group with no pod at all is created *whole*: its pods carry no
     scheduling gate and the label ``dwdp.io/gang=complete`` from the start (``Plan.whole_gangs``;
     apply creates them together and, if any of them is refused or fails, deletes the ones it
     created, so no partial gang is ever left schedulable). A group that already has some pods, or
     any DwdpGroup with a refused child on record (``status.refusals``: a quota may admit half a
     gang), takes the gated path: pods created gated and ``dwdp.io/gang=pending``, the gate lifted
     by patches once every pod of the attempt exists. An operator killed in the middle of a whole
     creation leaves pods labelled complete beside missing ones and no gangComplete: the next pass
     creates the missing ones (gated path) and the gang completes, no restart.
  3. ``groupRestarts`` counts restarts since the group's last rollout; ``history`` keeps the last 10.
  4. An invalid spec yields a status-only plan (condition Invalid + one Event per new message).
  5. Plans are ordered for apply: status, deletes, creates, patches, events. ``Plan.status_last``:
     a plan that only creates (no delete, no attempt number changed) writes its status once, after
     the creates, as the status the next pass will observe: ``Plan.status_after_creates``, derived
     in the same pass with the pods it creates counted (gang complete once every pod of the attempt
     exists), exactly what ``desired_state`` over those pods would say. One ``desired_state`` per
     pass, one status write per new group, not two.
  5a. A pass that records a pod loss (Degrade: ``lostPods`` and a new ``podRecreations`` entry) writes its
     status first even when it only creates (the lost pod already gone): were the status written after the
     replacement and that write failed (a conflict, the operator killed), the next pass would see every pod
     there and the loss — and the recreation budget it spends — would be forgotten.
  6. ``Plan.requeue_after`` is the time until the next transition that no API event announces
     (a backoff ending, a drain ending, a placement dead end maturing); the reconciler sleeps that
     long instead of polling. ``None``: only an event (or the long safety resync) changes anything.
  6a. A draining group whose pods still report prompt tokens waiting or running (``busy_groups``, read from
     their ``/v1/load``) is kept past ``drainUntil`` until it is idle — a scale-down never cuts an in-flight
     prefill — for at most ``DRAIN_BUSY_CAP_S`` (then the pods' own SIGTERM drain finishes what is left).
  7. Group state is typed (``state.GroupStatus``, frozen): each pass derives new values from the
     status it read; ``status.refusals`` (written by the reconciler from apply's answers) is carried
     over untouched and rendered as the ChildrenAccepted condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import labels as L
from . import manifests as M
from .degrade import Action, Decision, coverage_left, decide, fresh_failures, pod_ranks, ranks_of, recent
from .failures import group_failures, unschedulable_since
from .observed import slim_pod
from .restart import backoff_seconds, exhausted
from .spec import DwdpGroupSpec, parse_spec
from .state import (BUSY_PHASES, EventReason, EventType, Failure, FailureKind, GroupPhase, GroupStatus, LostPod,
                    PlannedEvent, RestartRecord, read_groups)
from .status import invalid_conditions, iso, object_status, parse_iso, summarize

HISTORY = 10
#: the longest a draining group is kept for prefill work still on it (a stuck or lying pod cannot hold a
#: scale-down forever; the pod's SIGTERM drain then answers what is left); it is re-checked this often
DRAIN_BUSY_CAP_S = 120.0
DRAIN_BUSY_RECHECK_S = 1.0


@dataclass
class Plan:
    status: dict[str, Any]
    creates: list[dict[str, Any]] = field(default_factory=list)      # manifests; AlreadyExists is fine
    deletes: list[tuple[str, str]] = field(default_factory=list)     # (kind, name); NotFound is fine
    patches: list[tuple[str, dict]] = field(default_factory=list)    # (pod name, merge patch)
    events: list[PlannedEvent] = field(default_factory=list)
    whole_gangs: list[list[str]] = field(default_factory=list)       # pod names created together (2a)
    status_after_creates: dict[str, Any] | None = None               # invariant 5 (only then)
    valid: bool = True
    requeue_after: float | None = None                               # invariant 6

    @property
    def status_last(self) -> bool:
        """Invariant 5: the status is written once, after the creates (``status_after_creates``)."""
        return self.status_after_creates is not None

    def event(self, etype: EventType, reason: EventReason, message: str) -> None:
        self.events.append(PlannedEvent(etype, reason, message))

    def wake_in(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def desired_state(cr: dict[str, Any], pods: list[dict[str, Any]], *, now: float, token: str = "",
                  health: dict[str, int] | None = None, drain_seconds: float = 5.0,
                  busy_groups: frozenset[int] = frozenset()) -> Plan:
    """Children and actions for one DwdpGroup. ``pods``: ``observed.slim_pod`` of its pods;
    ``health``: pod uid -> prefetch_restarts read from the pod's /healthz (missing = unknown);
    ``busy_groups``: draining groups still holding prefill work (invariant 6a)."""
    meta = cr.get("metadata") or {}
    name, ns, uid = meta["name"], meta.get("namespace", "default"), meta.get("uid", "")
    gen = meta.get("generation")
    old = dict(cr.get("status") or {})
    spec, errors = parse_spec(cr.get("spec"))
    if errors or spec is None:
        return _invalid(old, errors, now=now, generation=gen)

    thash = M.template_hash(spec)
    ctx = _Ctx(name=name, ns=ns, uid=uid, spec=spec, thash=thash, now=now, health=health or {},
               drain_seconds=drain_seconds, whole=not old.get("refusals"), busy=busy_groups)
    plan = Plan(status={})
    if not old.get("groups") and not old.get("templateHash"):
        plan.event(EventType.NORMAL, EventReason.CREATED,
                   f"creating {spec.numGroups} group(s) of {spec.pods_per_group} pod(s) x {spec.gpusPerPod} GPU(s)")
    plan.creates += [M.token_secret(name=name, ns=ns, uid=uid, token=token),
                     M.client_service(name=name, ns=ns, uid=uid, spec=spec),
                     M.rank_service(name=name, ns=ns, uid=uid, spec=spec),
                     M.network_policy(name=name, ns=ns, uid=uid, spec=spec)]
    if spec.imex.mode == "ComputeDomain":
        plan.creates.append(M.compute_domain(name=name, ns=ns, uid=uid))
    if spec.inferencePool is not None:
        plan.creates.append(M.inference_pool(name=name, ns=ns, uid=uid, spec=spec))
    elif old.get("inferencePool"):
        plan.deletes.append(("InferencePool", old["inferencePool"]))  # asked for before, not any more

    by_group: dict[int, list[dict]] = {}
    for p in pods:
        if p.get("group") is None or p.get("attempt") is None:
            plan.deletes.append(("Pod", p["name"]))  # ours by label but malformed: never adopt
            continue
        by_group.setdefault(p["group"], []).append(p)
    old_groups = read_groups(old)
    indices = sorted(set(range(spec.numGroups)) | set(old_groups) | set(by_group))

    groups: list[GroupStatus] = []
    for g in indices:
        gpods = by_group.get(g, [])
        if g < spec.numGroups:
            if g not in old_groups and old.get("templateHash"):
                plan.event(EventType.NORMAL, EventReason.SCALE_UP, f"group {g} added (numGroups={spec.numGroups})")
            groups.append(_live_group(ctx, plan, old_groups.get(g) or _new_group(g, thash), gpods))
        else:
            st = _surplus_group(ctx, plan, old_groups.get(g) or _new_group(g, thash), gpods, known=g in old_groups)
            if st is not None:
                groups.append(st)

    groups = _roll(ctx, plan, groups, by_group)
    for st in groups:
        _schedule_wake(ctx, plan, st, by_group.get(st.index, []))

    plan.status = object_status(spec, groups, name=name, thash=thash, old=old, now=now, generation=gen)
    attempts_kept = all(st.attempt == (old_groups[st.index].attempt if st.index in old_groups else 0) for st in groups)
    if attempts_kept and not plan.deletes and any(m["kind"] == "Pod" for m in plan.creates) \
            and not _records_a_loss(groups, old_groups):
        after = [ctx.after_creates.get(st.index, st) for st in groups]
        plan.status_after_creates = object_status(spec, after, name=name, thash=thash, old=old, now=now,
                                                  generation=gen)
    return plan


@dataclass
class _Ctx:
    name: str
    ns: str
    uid: str
    spec: DwdpGroupSpec
    thash: str
    now: float
    health: dict[str, int]
    drain_seconds: float
    whole: bool  # invariant 2a: a group with no pod may be created whole (no refusal on record)
    # invariant 5: a group's entry with the pods this pass creates counted (only groups that create)
    after_creates: dict[int, GroupStatus] = field(default_factory=dict)
    busy: frozenset[int] = frozenset()  # invariant 6a


def _records_a_loss(groups: list[GroupStatus], old_groups: dict[int, GroupStatus]) -> bool:
    """This pass records a pod loss (failurePolicy Degrade: a new entry in ``podRecreations``): its status is
    written before any create (invariant 5a), so the record and the budget survive a create or write that fails
    after the replacement exists."""
    def entries(st):
        return set(st.podRecreations or ()) if st is not None else set()
    return any(entries(st) - entries(old_groups.get(st.index)) for st in groups)


def _new_group(g: int, thash: str) -> GroupStatus:
    return GroupStatus(index=g, templateHash=thash)


def _delete_all(plan: Plan, gpods: list[dict]) -> None:
    plan.deletes += [("Pod", p["name"]) for p in gpods if not p["deleting"]]


def _live_group(ctx: _Ctx, plan: Plan, st: GroupStatus, gpods: list[dict]) -> GroupStatus:
    """One desired group (index < numGroups)."""
    g, spec, now = st.index, ctx.spec, ctx.now
    if st.phase == GroupPhase.DRAINING:  # scaled back up while draining: keep the pods, serve again
        st = st.model_copy(update={"phase": GroupPhase.PENDING, "drainUntil": None})
        plan.event(EventType.NORMAL, EventReason.SCALE_UP, f"group {g} kept (scaled back up while draining)")
    cur = [p for p in gpods if p["attempt"] == st.attempt]
    _delete_all(plan, [p for p in gpods if p["attempt"] != st.attempt])

    if st.phase == GroupPhase.FAILED:
        _delete_all(plan, gpods)
        if st.templateHash != ctx.thash:  # a new template earns a fresh restart budget
            st = st.model_copy(update={"phase": GroupPhase.UPDATING, "restartAt": iso(now), "groupRestarts": 0})
            plan.event(EventType.NORMAL, EventReason.ROLLING_UPDATE, f"group {g}: failed group retried with the new template")
        return _observe(ctx, st, [])

    if st.phase in (GroupPhase.RESTARTING, GroupPhase.UPDATING):
        _delete_all(plan, gpods)
        due = parse_iso(st.restartAt) or 0.0
        if gpods or now < due:
            return _observe(ctx, st, [])
        st = st.model_copy(update={"attempt": st.attempt + 1, "phase": GroupPhase.PENDING, "templateHash": ctx.thash,
                                   "gangComplete": False, "restartAt": None})
        cur, gpods = [], []
        plan.event(EventType.NORMAL, EventReason.GROUP_CREATED,
                   f"group {g} attempt {st.attempt}: creating {spec.pods_per_group} pods")

    failures = fresh_failures(st, group_failures(ctx.spec, ctx.name, st, cur, now=ctx.now))
    if failures:
        decision = decide(spec, st, failures, now=now)
        if decision.action == Action.RESTART_GROUP:
            return _restart(ctx, plan, st, cur, gpods, failures, note=decision.reason)
        st = _lose_pods(ctx, plan, st, cur, failures, decision)

    if st.phase == GroupPhase.DEGRADED:
        if st.templateHash != ctx.thash:  # _roll replaces it at once (a group not Ready)
            return _observe(ctx, st, cur)
        st = _recreate_lost(ctx, plan, st, cur)
        if st.phase == GroupPhase.DEGRADED:
            return _observe(ctx, st, cur)

    if st.templateHash != ctx.thash:  # rolled (or not yet) by _roll, within the budget
        return _ready_or_pending(ctx, _observe(ctx, st, cur))

    # create what is missing (a group with no pod: whole, invariant 2a), then lift the gang gate of a
    # gated gang once every pod of the attempt exists
    have = {p["name"] for p in gpods}
    whole = ctx.whole and not gpods
    missing = [i for i in range(spec.pods_per_group) if M.pod_name(ctx.name, g, i) not in have]
    created = []
    for i in missing:
        pod = M.worker_pod(name=ctx.name, ns=ctx.ns, uid=ctx.uid, g=g, i=i, attempt=st.attempt, spec=spec,
                           thash=ctx.thash, avoid_nodes=st.avoidNodes or (), whole=whole)
        plan.creates.append(pod)
        created.append(slim_pod(pod))
    if whole and missing:
        plan.whole_gangs.append([M.pod_name(ctx.name, g, i) for i in missing])
    live = [p for p in cur if not p["deleting"]]  # a terminating pod (a rolled-back one) does not complete a gang
    if len(live) == spec.pods_per_group:
        plan.patches += [(p["name"], M.lift_gate_patch()) for p in live if p["labels"].get(L.GANG) != "complete"]
    plan.patches += [(p["name"], M.serving_patch(True)) for p in cur if p["labels"].get(L.SERVING) != "true"]
    plan.patches += [(p["name"], M.role_patch()) for p in cur if L.LLMD_ROLE not in p["labels"]]
    if created:
        ctx.after_creates[g] = _settled(ctx, st, cur + created)
    return _settled(ctx, st, cur)


def _settled(ctx: _Ctx, st: GroupStatus, cur: list[dict]) -> GroupStatus:
    """A group that needs no restart, over its attempt's pods ``cur``: gang complete once every pod of
    the attempt is there (from then on a missing pod is a failure), Ready or Pending, placed once Ready."""
    if sum(1 for p in cur if not p["deleting"]) == ctx.spec.pods_per_group:
        st = st.model_copy(update={"gangComplete": True})
    st = _ready_or_pending(ctx, _observe(ctx, st, cur))
    if st.phase == GroupPhase.READY:
        st = st.model_copy(update={"avoidNodes": None})  # placed: the next restart may use any node again
    return st


def _lose_pods(ctx: _Ctx, plan: Plan, st: GroupStatus, cur: list[dict], failures: list[Failure],
               d: Decision) -> GroupStatus:
    """failurePolicy Degrade absorbs ``failures``: record the lost pods (by the uid that failed), count them
    against the budget, phase Degraded; ``_recreate_lost`` then deletes and recreates them."""
    spec, now = ctx.spec, ctx.now
    uid = {p["name"]: p["uid"] for p in cur}
    lost = {lp.pod: lp for lp in st.lostPods or ()}
    for i in d.pods:
        name = M.pod_name(ctx.name, st.index, i)
        why = "; ".join(f.text for f in failures if f.pod == i)
        lost[i] = LostPod(pod=i, ranks=list(pod_ranks(spec, i)), uid=uid.get(name, ""), reason=why, since=iso(now))
    window = recent(st.podRecreations, now=now, window_s=spec.degrade.windowSeconds) + [iso(now)] * len(d.pods)
    serving = spec.dwdpSize - len(d.lost_ranks)
    for i in d.pods:
        lp = lost[i]
        plan.event(EventType.WARNING, EventReason.RANK_LOST,
                   f"group {st.index}: pod {M.pod_name(ctx.name, st.index, i)} (rank(s) {lp.ranks}) lost ({lp.reason}); "
                   f"failurePolicy Degrade: recreating only that pod at attempt {st.attempt}, the others keep "
                   f"serving ({serving}/{spec.dwdpSize} ranks); coverage left {d.coverage} (fewest surviving "
                   f"holders of an expert); recreation {len(window)}/{spec.degrade.maxPodRecreations} within "
                   f"{spec.degrade.windowSeconds}s")
    return st.model_copy(update={"phase": GroupPhase.DEGRADED, "lostPods": [lost[i] for i in sorted(lost)],
                                 "missingRanks": list(d.lost_ranks), "coverage": d.coverage,
                                 "podRecreations": window})


def _recreate_lost(ctx: _Ctx, plan: Plan, st: GroupStatus, cur: list[dict]) -> GroupStatus:
    """A Degraded group: delete each lost pod that is still there (the uid that failed), create it again once
    gone (same name, same attempt, gang complete: it joins the running group), and forget it once its
    replacement is Ready (Event RankRejoined). With none left the group is whole again (phase from the pods)."""
    spec, g = ctx.spec, st.index
    by_name = {p["name"]: p for p in cur}
    left, created = [], []
    for lp in st.lostPods or ():
        name = M.pod_name(ctx.name, g, lp.pod)
        p = by_name.get(name)
        if p is None:
            pod = M.worker_pod(name=ctx.name, ns=ctx.ns, uid=ctx.uid, g=g, i=lp.pod, attempt=st.attempt, spec=spec,
                               thash=ctx.thash, whole=True)
            plan.creates.append(pod)
            created.append(slim_pod(pod))
            left.append(lp)
        elif p["uid"] == lp.uid or p["deleting"]:
            if not p["deleting"]:
                plan.deletes.append(("Pod", name))
            left.append(lp)
        elif p["ready"] and p["phase"] == "Running":
            since = parse_iso(lp.since)
            took = f" {ctx.now - since:.0f}s after its loss" if since is not None else ""
            plan.event(EventType.NORMAL, EventReason.RANK_REJOINED,
                       f"group {g}: pod {name} (rank(s) {lp.ranks}) Ready again{took}: rejoined the running group "
                       f"at attempt {st.attempt}")
        else:
            left.append(lp)  # the replacement is starting
    plan.patches += [(p["name"], M.serving_patch(True)) for p in cur if p["labels"].get(L.SERVING) != "true"]
    plan.patches += [(p["name"], M.role_patch()) for p in cur if L.LLMD_ROLE not in p["labels"]]
    if left:
        missing = ranks_of(spec, (lp.pod for lp in left))
        st = st.model_copy(update={"lostPods": left, "missingRanks": list(missing),
                                   "coverage": coverage_left(spec, missing)})
        if created:
            ctx.after_creates[g] = _observe(ctx, st, cur + created)
        return st
    plan.event(EventType.NORMAL, EventReason.RANK_REJOINED,
               f"group {g}: every lost pod rejoined; full capacity ({spec.dwdpSize} ranks, coverage "
               f"{coverage_left(spec, ())})")
    return st.model_copy(update={"phase": GroupPhase.PENDING, "lostPods": None, "missingRanks": None,
                                 "coverage": None})


def _restart(ctx: _Ctx, plan: Plan, st: GroupStatus, cur: list[dict], gpods: list[dict],
             failures: list[Failure], note: str = "") -> GroupStatus:
    spec, now = ctx.spec, ctx.now
    why = "; ".join(f.text for f in failures) + (f"; {note}" if note else "")
    n = st.groupRestarts
    hist = st.history[-(HISTORY - 1):] + [RestartRecord(attempt=st.attempt, time=iso(now), reason=why)]
    dead_end = any(f.kind == FailureKind.PLACEMENT_DEAD_END for f in failures)
    avoid = sorted({p["node"] for p in cur if p["node"]}) if dead_end else None
    st = st.model_copy(update={"history": hist, "lastRestartTime": iso(now), "lastRestartReason": why,
                               "avoidNodes": avoid, "lostPods": None, "missingRanks": None, "coverage": None,
                               "podRecreations": None})
    _delete_all(plan, gpods)
    if exhausted(n, max_restarts=spec.restartPolicy.maxRestarts):
        st = st.model_copy(update={"phase": GroupPhase.FAILED, "restartAt": None})
        plan.event(EventType.WARNING, EventReason.GROUP_FAILED,
                   f"group {st.index} attempt {st.attempt} failed ({why}); restart budget "
                   f"maxRestarts={spec.restartPolicy.maxRestarts} spent")
    else:
        delay = backoff_seconds(n, base=spec.restartPolicy.backoffSeconds)
        st = st.model_copy(update={"phase": GroupPhase.RESTARTING, "groupRestarts": n + 1,
                                   "restartAt": iso(now + delay)})
        plan.event(EventType.WARNING, EventReason.GROUP_RESTART,
                   f"group {st.index} attempt {st.attempt} failed ({why}); restart "
                   f"{n + 1}/{spec.restartPolicy.maxRestarts} in {delay:g}s")
    return _observe(ctx, st, [])


def _ready_or_pending(ctx: _Ctx, st: GroupStatus) -> GroupStatus:
    ready = st.readyPods == ctx.spec.pods_per_group
    return st.model_copy(update={"phase": GroupPhase.READY if ready else GroupPhase.PENDING})


def _surplus_group(ctx: _Ctx, plan: Plan, st: GroupStatus, gpods: list[dict], *, known: bool) -> GroupStatus | None:
    """A group beyond numGroups: drain it, delete it, then forget it (None)."""
    g = st.index
    if not gpods:
        if known:
            plan.event(EventType.NORMAL, EventReason.SCALE_DOWN, f"group {g} removed")
        return None
    if st.phase != GroupPhase.DRAINING:
        st = st.model_copy(update={"phase": GroupPhase.DRAINING, "drainUntil": iso(ctx.now + ctx.drain_seconds),
                                   "restartAt": None})
        plan.event(EventType.NORMAL, EventReason.SCALE_DOWN, f"group {g} draining: removed from the client Service, "
                                                              f"deleted in {ctx.drain_seconds:g}s")
    plan.patches += [(p["name"], M.serving_patch(False)) for p in gpods
                     if p["labels"].get(L.SERVING) != "false" and not p["deleting"]]
    until = parse_iso(st.drainUntil) or 0.0
    if ctx.now >= until:
        if g in ctx.busy and ctx.now < until + DRAIN_BUSY_CAP_S:
            plan.wake_in(DRAIN_BUSY_RECHECK_S)  # prefill still running on it: look again soon
        else:
            _delete_all(plan, gpods)
    return _observe(ctx, st, [p for p in gpods if p["attempt"] == st.attempt])


def _roll(ctx: _Ctx, plan: Plan, groups: list[GroupStatus], by_group: dict) -> list[GroupStatus]:
    """Start rolling outdated groups: unavailable ones at once, Ready ones within the budget."""
    live = [st for st in groups if st.index < ctx.spec.numGroups]
    outdated = [st for st in live if st.phase in (GroupPhase.PENDING, GroupPhase.READY, GroupPhase.DEGRADED)
                and st.templateHash != ctx.thash]
    start = {st.index for st in outdated if st.phase != GroupPhase.READY}
    budget = ctx.spec.rollout.maxUnavailableGroups - sum(1 for st in live if st.phase != GroupPhase.READY)
    for st in sorted([s for s in outdated if s.phase == GroupPhase.READY], key=lambda s: -s.index):
        if budget <= 0:
            break
        start.add(st.index)
        budget -= 1
    out = []
    for st in groups:
        if st.index in start:
            _delete_all(plan, by_group.get(st.index, []))
            plan.event(EventType.NORMAL, EventReason.ROLLING_UPDATE,
                       f"group {st.index}: replacing attempt {st.attempt} with template {ctx.thash}")
            st = st.model_copy(update={"phase": GroupPhase.UPDATING, "restartAt": iso(ctx.now), "readyPods": 0,
                                       "lostPods": None, "missingRanks": None, "coverage": None})
        out.append(st)
    return out


def _schedule_wake(ctx: _Ctx, plan: Plan, st: GroupStatus, gpods: list[dict]) -> None:
    """Invariant 6: when this group next changes without an API event."""
    if st.phase in (GroupPhase.RESTARTING, GroupPhase.UPDATING) and st.restartAt:
        plan.wake_in((parse_iso(st.restartAt) or ctx.now) - ctx.now)
    if st.phase == GroupPhase.DRAINING and st.drainUntil and (parse_iso(st.drainUntil) or 0.0) > ctx.now:
        plan.wake_in((parse_iso(st.drainUntil) or ctx.now) - ctx.now)  # past it: the busy recheck (6a) asks
    if st.phase in BUSY_PHASES or st.phase == GroupPhase.DEGRADED:  # a recreated pod may be the stuck one
        _, since = unschedulable_since(ctx.spec, [p for p in gpods if p["attempt"] == st.attempt], now=ctx.now)
        if since is not None:
            plan.wake_in(since + ctx.spec.restartPolicy.unschedulableSeconds - ctx.now)


def _observe(ctx: _Ctx, st: GroupStatus, cur: list[dict]) -> GroupStatus:
    live = [p for p in cur if not p["deleting"]]
    known = [ctx.health[p["uid"]] for p in live if p["uid"] in ctx.health]
    return st.model_copy(update={
        "pods": len(live),
        "readyPods": sum(1 for p in live if p["ready"] and p["phase"] == "Running"),
        "podRestarts": sum(p["restarts"] for p in cur),
        "prefetchRestarts": int(sum(known)) if known else st.prefetchRestarts,
    })


def _invalid(old: dict, errors: list[str], *, now: float, generation: int | None) -> Plan:
    status = dict(old)
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == "Invalid"), None)
    status["observedGeneration"] = generation
    status["conditions"] = invalid_conditions(errors, old=old.get("conditions"), now=now, generation=generation)
    status.update(summarize(status["conditions"]))
    msg = "; ".join(errors)
    plan = Plan(status=status, valid=False)
    if not prev or prev.get("status") != "True" or prev.get("message") != msg:
        plan.event(EventType.WARNING, EventReason.INVALID_SPEC, msg)
    return plan
